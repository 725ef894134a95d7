#!/usr/bin/env bash
# Run on a GPU machine from the repository root (no install needed): doctor, GPU tests, cross-compile
# tests and bench suites.  Logs and bench JSON/PNG go to $OUT (default ./gpu-out).
#   tools/gpu-check.sh [SUITE ...]            every test file, then the suites (default: every suite)
#   TESTS="tests/test_quant.py" tools/gpu-check.sh quant     only those tests, then the quant suite
#   TESTS=none tools/gpu-check.sh attention                   no tests
# Each pytest file gets its own log and a time limit (STEP_TIMEOUT, default 240 s): on a GPU every kernel
# test compiles its own specializations, and the whole suite takes well over 5 minutes.
# With bitsandbytes wheels in .whl/ (../shared/tools/gpu-wheels.sh), they are installed into .gpu-site.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu-site .whl/*.whl
fi
export PYTHONPATH=$PWD:$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
python3 -m anygpu doctor > "$OUT/doctor.txt" 2>&1 || status=1
tests=${TESTS:-$(ls tests/test_*.py)}
if [ "$tests" != none ]; then
  for t in $tests; do
    log="$OUT/pytest-$(basename "$t" .py).txt"
    timeout "$STEP_TIMEOUT" python3 -m pytest -q -rfE -p no:cacheprovider -m "not aot" "$t" > "$log" 2>&1
    rc=$?; [ $rc = 0 ] || [ $rc = 5 ] || status=1
    echo "$t: rc=$rc $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1)"
    grep -E "^(FAILED|ERROR)" "$log" | head -n 10
  done
fi
suites=("$@"); [ ${#suites[@]} -gt 0 ] || suites=($(python3 -m anygpu.cli bench --list | awk '{print $1}'))
for s in "${suites[@]}"; do
  timeout "$STEP_TIMEOUT" python3 -m anygpu.cli bench "$s" --json "$OUT/bench-$s.json" --png "$OUT/bench-$s.png" \
    > "$OUT/bench-$s.txt" 2>&1 || status=1
  grep -v "case/s" "$OUT/bench-$s.txt" | tail -n 60
done
exit $status
