"""Which registered kernels this Triton moves between register layouts through shared memory (a tuning aid).

A ``convert_layout`` in a kernel's TTGIR that the backend lowers through shared memory costs a store and a load
of every element it moves, on the same L1 pipe as the kernel's own loads.  Triton versions differ here: the
8-bit optimizer step compiled with 11 such conversions on triton 3.6 (the H200's), 3 without shared memory on
3.9, and taking its gathers out of them made it 1.2x faster on the H200 (docs/perf/2026-11-30-h200-log.md).
For each kernel, config and the first dtype: the conversions of big tensors (the tensor type) and the PTX / AMDGCN
shared-memory instructions, by cross-compiling for a target (no GPU needed).
Usage: python3 tools/layout_report.py [TARGET (sm_90)] [NAME-SUBSTRING ...]"""

import re
import sys

import triton
from triton.compiler import ASTSource

from anygpu.backend.targets import lookup
from anygpu.kernels import load_all
from anygpu.kernels.aot import constexprs_for
from anygpu.kernels.launch import select

SHARED = {"ptx": ("ld.shared", "st.shared", "ldmatrix", "stmatrix"), "amdgcn": ("ds_read", "ds_write")}


def main(arch: str, names: list[str]) -> None:
    target = lookup(arch)
    print(f"triton {triton.__version__}, target {arch}")
    for name, spec in sorted(load_all().items()):
        if names and not any(part in name for part in names):
            continue
        dtype = spec.dtypes[0]
        for cfg in select(spec.configs, target):
            src = ASTSource(fn=spec.fn, signature=spec.signature_for(dtype, cfg),
                            constexprs=constexprs_for(spec, cfg, target),
                            attrs=spec.attrs(dtype))
            try:
                kernel = triton.compile(src, target=target.triton_target(), options=cfg.options(target))
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name} {cfg.label()}: compile failed: {str(e)[:120]}")
                continue
            converts = re.findall(r"ttg\.convert_layout %\S+ : (tensor<[^,>]+)", kernel.asm["ttgir"])
            asm_kind = "ptx" if "ptx" in kernel.asm else "amdgcn"
            counts = {op: kernel.asm[asm_kind].count(op) for op in SHARED[asm_kind]}
            print(f"{name} {cfg.label()}: {len(converts)} conversions {sorted(set(converts))}; {counts}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "sm_90", args[1:])
