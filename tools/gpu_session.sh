#!/usr/bin/env bash
# One bundled GPU session (the device tool): install the carried wheels, then run what the arguments name.
# Usage on the device: bash tools/gpu_session.sh STEP...
# steps: tests-engine, tests-issue4, tests-int8, tests-tp, bench-engine, bench-int8, bench-optim, bench-tp, bench-serve,
# ncu-gemv (Nsight Compute on the decode GEMVs: tools/ncu_gemv.py; NCU_WEIGHT=q4_k for GGUF's),
# linear-q4 (the arithmetic Q4 decoder's GPU tests, then the engine's q4_k decode with it off and on: ANYGPU_LINEAR_4BIT)
# sweep-gemm-rows (tools/sweep_gemm_rows.py: the 64-row GEMM tile for Q4_K, NF4, Q8_0),
# quant-matmul (the quant suite's NF4 and Q4_K matmul rows only), bench-formats (bf16, nf4, int8, q4_k, q8_0 in one
# engine run, batch 1 and 64 prompts), tests-decode-quantize and bench-decode-quantize (paged decode, blockwise
# quantize, the 8-bit optimizers; AB_OLD=DIR: an older tree's numbers beside these)
# (tests-tp and bench-tp need two GPUs: the nvidia-h200-x2 kind.)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu-site .whl/*.whl \
  2>&1 | grep -v "^WARNING" | tail -3
export PYTHONPATH=$PWD:$PWD/.gpu-site
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests-engine)
      timeout 300 python3 -m pytest -q -x tests/test_engine_gpu.py tests/test_engine_sampler.py 2>&1 | tail -15 ;;
    tests-issue4)
      timeout 300 python3 -m pytest -q -m gpu tests/test_optim_8bit.py tests/test_int8_matmul.py \
        tests/test_tunable_quantized.py 2>&1 | tail -15 ;;
    tests-int8)
      timeout 200 python3 -m pytest -q -m gpu tests/test_int8_matmul.py tests/test_int8.py 2>&1 | tail -8 ;;
    bench-engine)
      for q in "" "--quantize nf4"; do
        timeout 240 python3 -m anygpu.cli bench model --random-config llama3-8b --num-prompts 1 --input-len 128 \
          --output-len 256 --no-baseline $q --json "$OUT/model_b1${q:+_nf4}.json" 2>&1 | grep -v "it/s\]" | tail -8
      done
      timeout 400 python3 -m anygpu.cli bench model --random-config llama3-8b --num-prompts 64 --input-len 512 \
        --output-len 256 --json "$OUT/model_c64.json" 2>&1 | grep -v "it/s\]" | tail -8 ;;
    tests-tp)
      timeout ${TP_TEST_TIMEOUT:-400} python3 -m pytest -q -x -m gpu tests/test_engine_gpu.py -k "${TP_TESTS:-tp2}" \
        > "$OUT/tests_tp.log" 2>&1; tail -15 "$OUT/tests_tp.log" ;;
    bench-tp)
      for tp in ${TPS:-1 2}; do
        timeout ${TP_BENCH_TIMEOUT:-240} python3 -m anygpu.cli bench model --random-config llama3-8b --num-prompts 1 \
          --input-len 128 --output-len 256 --no-baseline --tp $tp --json "$OUT/model_b1_tp$tp.json" > "$OUT/bench_tp$tp.log" 2>&1
        echo "exit $?"; grep -v "it/s\]" "$OUT/bench_tp$tp.log" | tail -6
      done ;;
    bench-serve)
      timeout ${SERVE_TIMEOUT:-500} python3 -m anygpu.cli bench serve --random-config llama3-8b --num-prompts ${SERVE_PROMPTS:-512} \
        --concurrency 256 --input-len 512 --output-len 256 --half-load --client-procs 4 \
        --json "$OUT/serve_c256.json" > "$OUT/serve.log" 2>&1; echo "exit $?"; grep -v "it/s\]" "$OUT/serve.log" | tail -30 ;;
    bench-int8)
      timeout 200 python3 -m anygpu.cli bench int8 --json "$OUT/int8.json" 2>&1 | tail -25 ;;
    ncu-gemv)
      ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      metrics=$(python3 tools/ncu_gemv.py --metrics)
      timeout 240 "$ncu" --clock-control none -k regex:_gemv -s 2 -c 2 --metrics "$metrics" python3 tools/ncu_gemv.py --weight ${NCU_WEIGHT:-nf4} > "$OUT/ncu_gemv.txt" 2>&1; echo "exit $?"; grep -v "^==PROF==" "$OUT/ncu_gemv.txt" | tail -30 ;;
    linear-q4)
      ANYGPU_LINEAR_4BIT=1 timeout 200 python3 -m pytest -q -x tests/test_matmul_4bit_offset.py tests/test_gguf_gpu_packed.py \
        tests/test_decode_4bit_ptx.py 2>&1 | tail -3
      for on in 0 1 0 1; do
        ANYGPU_LINEAR_4BIT=$on timeout 150 python3 -m anygpu.cli bench model --random-config llama3-8b --num-prompts 1 \
          --input-len 128 --output-len 256 --no-baseline --quantize bf16,q4_k -q --json "$OUT/q4k_b1_linear$on.json" \
          2>&1 | grep "anygpu\|vs the" | sed "s/^/linear=$on  /"
      done ;;
    bench-formats)
      # every weight format on one workload, ratios in one run: batch 1, then 64 prompts
      timeout 200 python3 -m anygpu.cli bench model --random-config llama3-8b --num-prompts 1 --input-len 128 \
        --output-len 256 --no-baseline --quantize bf16,nf4,int8,q4_k,q8_0 -q --json "$OUT/formats_b1.json" 2>&1 | tail -9
      timeout 300 python3 -m anygpu.cli bench model --random-config llama3-8b --num-prompts 64 --input-len 512 \
        --output-len 256 --no-baseline --quantize bf16,nf4,int8,q4_k,q8_0 -q --json "$OUT/formats_c64.json" 2>&1 | tail -9 ;;
    sweep-gemm-rows)
      for f in q4_k nf4 q8_0; do timeout 280 python3 tools/sweep_gemm_rows.py --format $f --rows 64 2>&1 | grep -v Warning; done ;;
    quant-matmul)
      timeout 300 python3 -m anygpu.cli bench quant --op matmul_q4_k --op matmul_nf4 -q --json "$OUT/quant_matmul.json" \
        2>&1 | tail -40 ;;
    bench-optim)
      timeout 300 python3 -m anygpu.cli bench optim --json "$OUT/optim.json" 2>&1 | tail -12 ;;
    tests-decode-quantize)
      # paged decode's combines (the wide one on Hopper), PDL, blockwise quantize's keyed table, the optimizers
      timeout 400 python3 -m pytest -q -x -m "not aot" tests/test_paged_attention.py tests/test_pdl.py \
        tests/test_quant_blockwise_lut.py tests/test_quant.py tests/test_optim_8bit.py 2>&1 | tail -8 ;;
    bench-decode-quantize)
      # paged decode, 8-bit blockwise quantize and the 8-bit optimizer step; AB_OLD=DIR (a `git archive REV anygpu`
      # unpacked there) runs each suite in that tree first, then here, then both again
      root=$PWD
      for tree in ${AB_OLD:+$AB_OLD} . ${AB_OLD:+$AB_OLD .}; do
        for suite in "attention --op paged_decode" "quant --op quantize_blockwise" optim; do
          echo "--- $tree: bench $suite"
          (cd $tree && PYTHONPATH=$PWD:$root/.gpu-site timeout 200 python3 -m anygpu.cli bench $suite 2>&1 | tail -8)
        done
      done ;;
  esac
done
