#!/usr/bin/env bash
# Run on a GPU machine from the repository root (no install needed): doctor, the GPU tests, the
# cross-compile tests and every bench suite.  Logs and bench JSON/PNG go to $OUT (default ./gpu-out).
# Usage: tools/gpu-check.sh [SUITE ...]     (default: every suite)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
python3 -m anygpu doctor 2>&1 | tee "$OUT/doctor.txt" || status=1
python3 -m pytest -q -m "not aot" -x 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -n 30; [ "${PIPESTATUS[0]}" = 0 ] || status=1
python3 -m pytest -q -m aot 2>&1 | tail -n 5; [ "${PIPESTATUS[0]}" = 0 ] || status=1
suites=("$@"); [ ${#suites[@]} -gt 0 ] || suites=($(python3 -m anygpu.cli bench --list | awk '{print $1}'))
for s in "${suites[@]}"; do
  python3 -m anygpu.cli bench "$s" --json "$OUT/bench-$s.json" --png "$OUT/bench-$s.png" || status=1
done
exit $status
