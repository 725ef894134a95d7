"""The GPU targets anygpu knows, with the limits kernels must respect.

One table serves two purposes: at run time it gives the limits of the GPU we are on (torch does not
report LDS caps or fp8 flavours), and in CI it is the list of targets every kernel is cross-compiled
for.  Arch predicates are data here, not string tests scattered through the code, so they can be
unit-tested (a hand-written ``"gfx1200" or "gfx1201" in arch`` is always true; see torchao's bug).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

KiB = 1024


@dataclass(frozen=True)
class Target:
    arch: str  # "gfx942", "sm_90"
    vendor: str  # "amd" | "nvidia"
    family: str  # "cdna3", "rdna3", "hopper", ...
    warp_size: int  # threads per wavefront / warp
    shared_per_block: int  # bytes of LDS / shared memory one program may use (NVIDIA: the opt-in maximum)
    shared_per_cu: int  # bytes per CU / SM (occupancy)
    max_threads_per_cu: int  # resident threads per CU / SM (occupancy)
    max_blocks_per_cu: int
    fp8: tuple[str, ...]  # torch dtype names of the hardware's fp8 formats, () if none
    matrix_unit: str  # "mfma" | "wmma" | "mma" | "wgmma" | "tcgen05"
    products: str
    # Registers one thread may use, as the cross-compile report counts them (AMD: VGPRs + AGPRs).
    max_registers: int = 255
    known: bool = True  # False for a target synthesised from an arch name we have no row for

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"

    @property
    def max_num_warps(self) -> int:
        """num_warps counts wavefronts on AMD: 16 x wave64 is already the 1024-thread block limit."""
        return 1024 // self.warp_size

    @property
    def fp8_fnuz(self) -> bool:
        return "float8_e4m3fnuz" in self.fp8

    def fp8_dtypes(self):
        import torch

        return tuple(getattr(torch, n) for n in self.fp8 if hasattr(torch, n))

    def triton_target(self):
        """A ``triton.backends.compiler.GPUTarget`` for cross-compiling to this target."""
        from triton.backends.compiler import GPUTarget

        if self.is_amd:
            return GPUTarget("hip", self.arch, self.warp_size)
        return GPUTarget("cuda", int(self.arch[3:]), 32)


_OCP = ("float8_e4m3fn", "float8_e5m2")
_FNUZ = ("float8_e4m3fnuz", "float8_e5m2fnuz")


def _amd(arch, family, warp, lds, waves_per_cu, fp8, unit, products):
    # AMD has no fixed "blocks per CU"; waves are the limit, so allow one block per resident wave.
    # RDNA reports WGPs as its multiprocessors (WGP mode), and a WGP holds 128 KiB of LDS, 64 KiB per group.
    lds_per_cu = 2 * lds if warp == 32 else lds
    # CDNA: 256 VGPRs + 256 AGPRs per lane (one file on gfx90a and later, two on gfx908); RDNA: 256 VGPRs.
    registers = 512 if unit == "mfma" else 256
    return Target(arch, "amd", family, warp, lds, lds_per_cu, waves_per_cu * warp, waves_per_cu, fp8, unit, products,
                  registers)


def _nv(cc, family, smem_block, smem_sm, threads_sm, blocks_sm, fp8, unit, products):
    # Every CUDA GPU since Volta: 64 K 32-bit registers per SM, at most 255 per thread.
    return Target(f"sm_{cc}", "nvidia", family, 32, smem_block, smem_sm, threads_sm, blocks_sm, fp8, unit, products, 255)


# LDS: 64 KiB per workgroup on CDNA1/2/3 and RDNA; 160 KiB on gfx950 (ROCm GPU specs).  CDNA2/3 CUs hold
# 4 SIMDs x 8 waves, CDNA1 (gfx908) 4 x 10 (the compiler's occupancy ceiling for it); RDNA WGPs report as the
# "multiprocessor" and hold 4 SIMDs x 16 wave32.
# NVIDIA numbers are the opt-in per-block shared memory (the SM's shared memory less the 1 KiB the driver
# reserves per block) and per-SM limits of the CUDA guide's compute-capability table (CCCL's arch_traits
# carries the same numbers).  Triton's launcher opts a kernel in when it needs more than the default 48 KiB.
TARGETS: dict[str, Target] = {
    t.arch: t
    for t in [
        _amd("gfx908", "cdna1", 64, 64 * KiB, 40, (), "mfma", "MI100"),
        _amd("gfx90a", "cdna2", 64, 64 * KiB, 32, (), "mfma", "MI210, MI250, MI250X"),
        _amd("gfx942", "cdna3", 64, 64 * KiB, 32, _FNUZ, "mfma", "MI300X, MI300A, MI325X"),
        _amd("gfx950", "cdna4", 64, 160 * KiB, 32, _OCP, "mfma", "MI350X, MI355X"),
        _amd("gfx1100", "rdna3", 32, 64 * KiB, 64, (), "wmma", "RX 7900 XTX / XT, PRO W7900"),
        _amd("gfx1101", "rdna3", 32, 64 * KiB, 64, (), "wmma", "RX 7800 XT, 7700 XT"),
        _amd("gfx1200", "rdna4", 32, 64 * KiB, 64, _OCP, "wmma", "RX 9060 XT"),
        _amd("gfx1201", "rdna4", 32, 64 * KiB, 64, _OCP, "wmma", "RX 9070 XT, AI PRO R9700"),
        _nv(80, "ampere", 163 * KiB, 164 * KiB, 2048, 32, (), "mma", "A100, A800"),
        _nv(86, "ampere", 99 * KiB, 100 * KiB, 1536, 16, (), "mma", "RTX 3090, A10, A40"),
        _nv(89, "ada", 99 * KiB, 100 * KiB, 1536, 24, _OCP, "mma", "L4, L40S, RTX 4090"),
        _nv(90, "hopper", 227 * KiB, 228 * KiB, 2048, 32, _OCP, "wgmma", "H100, H200, GH200"),
        _nv(100, "blackwell", 227 * KiB, 228 * KiB, 2048, 32, _OCP, "tcgen05", "B200, GB200"),
        # Consumer Blackwell is its own family: Ada's SM limits, mma (no tcgen05), not sm_100's 227 KiB.
        _nv(120, "blackwell-consumer", 99 * KiB, 100 * KiB, 1536, 24, _OCP, "mma",
            "RTX 5090, RTX 5080, RTX PRO 6000 Blackwell"),
    ]
}

# What CI cross-compiles every kernel config for, every dtype aligned, one unaligned (``kernels/aot.jobs_for``).
CI_TARGETS = ("gfx942", "gfx90a", "gfx1100", "gfx950", "sm_80", "sm_90")
# What CI cross-compiles every kernel config for once (bf16 where the kernel takes it, aligned): each is a
# family the six above do not cover, and the dtype x variant product adds compile time, not coverage of
# the table's per-target entries.
CI_ONCE_TARGETS = ("gfx908", "gfx1201", "sm_89", "sm_100", "sm_120")

_GFX = re.compile(r"^gfx([0-9]{1,2})([0-9a-f])([0-9a-f])$")
_SM = re.compile(r"^sm_([0-9]{2,3})a?$")


def parse_gcn_arch(gcn_arch_name: str) -> str:
    """``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"``.  Raises ValueError on anything that is not a gfx name."""
    arch = str(gcn_arch_name).strip().split(":")[0].lower()
    if not _GFX.match(arch):
        raise ValueError(f"gcnArchName: expected a name like 'gfx942:sramecc+:xnack-', got {gcn_arch_name!r}")
    return arch


def cuda_arch(major: int, minor: int) -> str:
    return f"sm_{major}{minor}"


def lookup(arch: str) -> Target:
    """The table row for ``arch``; for an arch we have no row for, a conservative guess marked ``known=False``."""
    arch = str(arch).strip().lower()
    m = _SM.match(arch)
    if m:
        arch = f"sm_{m.group(1)}"  # sm_90a is sm_90 with arch-specific instructions, which Triton picks itself
    if arch in TARGETS:
        return TARGETS[arch]
    m = _GFX.match(arch)
    if m:
        major = int(m.group(1))
        # Triton derives the wave size from the arch the same way: gfx10 and later are wave32.
        if major >= 10:
            # gfx101x is RDNA1, gfx103x RDNA2 (no matrix cores); WMMA arrived with RDNA3 (gfx11).
            family = {10: "rdna1" if m.group(2) in "01" else "rdna2", 11: "rdna3", 12: "rdna4"}.get(major, f"gfx{major}")
            warp, waves, unit = 32, 64, ("wmma" if major >= 11 else "none")
        else:
            family, warp, waves, unit = "gcn/cdna", 64, 32, "mfma"
        return replace(_amd(arch, family, warp, 64 * KiB, waves, (), unit, "unknown"), known=False)
    m = _SM.match(arch)
    if m:
        cc = int(m.group(1))
        # The limits every CUDA GPU since Volta meets: 48 KiB of shared memory per block without opt-in,
        # 64 KiB per SM and 1024 resident threads (Turing's).  fp8 from Ada (sm_89) on.
        return Target(arch, "nvidia", "unknown", 32, 48 * KiB, 64 * KiB, 1024, 16, _OCP if cc >= 89 else (), "mma",
                      "unknown", 255, known=False)
    raise ValueError(f"arch: expected a gfx name (e.g. 'gfx942') or an sm name (e.g. 'sm_90'), got {arch!r}")


def parse_target_list(text: str) -> list[Target]:
    """``"gfx942,sm_90"`` -> targets; ``"all"`` -> every row; ``"ci"`` -> CI's full list; ``"ci-once"`` -> the
    targets CI compiles each config of once."""
    text = text.strip()
    if text in ("all", ""):
        return list(TARGETS.values())
    if text == "ci":
        return [TARGETS[a] for a in CI_TARGETS]
    if text == "ci-once":
        return [TARGETS[a] for a in CI_ONCE_TARGETS]
    return [lookup(a.strip()) for a in text.split(",") if a.strip()]
