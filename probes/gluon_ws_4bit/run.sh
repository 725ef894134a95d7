unset TRITON_INTERPRET
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu-site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/.gpu-site
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 110 python3 probes/gluon_ws_4bit/bench.py 64 2>&1 | grep -v Warn
timeout 60 python3 -m pytest -q -m gpu tests/test_nn_4bit.py -k dropped 2>&1 | grep "^E \|passed\|failed\|FAILED" | tail -5
