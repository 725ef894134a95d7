"""Split-K partial sums, added inside the matmul kernel that made them.

A kernel that splits K across SPLITS programs has each program write its fp32 partial sums to its own slice of a
[SPLITS, M, N] buffer (``store_or_reduce``), then count itself in on an int32 counter of its output tile
(``last_arrival``): its threads' stores, a barrier, one ``acq_rel`` atomic add at GPU scope (release: the
program's partials are visible before its count is; acquire: the last one sees every other program's).  The
program whose add returns SPLITS - 1 is the last of its tile: it loads the tile's SPLITS slices in the fixed order
0 .. SPLITS - 1 with ``.cg`` loads (from L2: L1 is not coherent across SMs), adds the bias, casts, stores the
output and sets the counter back to 0 (``add_partials``).  Deterministic: the same additions in the same order on
every run, the same bits as the separate reduce kernel below; one launch instead of two, and no program waits.

NVIDIA GPUs and Triton's interpreter only: AMD GPUs keep the second launch (``counters`` says why).

Counters: one int32 zero buffer per device (``counters``), made only outside CUDA-graph capture, grown there, never
freed (a captured graph keeps the address it was captured with); every launch leaves the counters it used at 0,
so graph replays need no memset.  Partials are a fresh ``torch.empty`` per call (fine under capture).  A launch
captured while the device has no buffer large enough falls back to writing the partials only and adding them
with ``_split_k_reduce_kernel`` (``reduce_partials``), a second launch: ``split_k_buffers`` decides, ``finish``
runs the fallback's reduce.  Launchers share one host helper, ``split_k_buffers``; the GEMV and GEMM kernels of
the 4-bit and int8-block formats share their epilogues, ``store_row`` and ``store_tile``.  The counters assume a
device's split-K launches run one at a time (in one stream's order): two at once on two streams would share
counters.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, on_device, register


@triton.jit
def last_arrival(counter_ptr, tile, SPLITS):
    """Count this program in on output tile ``tile``'s counter, after its partial stores; True in the program that
    arrives last (the counter is then set back to 0 for the next launch)."""
    tl.debug_barrier()  # every thread's partial stores come before the release of the add below
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    # Triton runs a scalar atomic in one thread and hands the old value to the others (a warp shuffle with one warp,
    # shared memory with more): neither orders their later loads after the acquire, this barrier does.
    tl.debug_barrier()
    last = arrived == SPLITS - 1
    if last:
        tl.store(counter_ptr + tile, 0)  # every other program of the tile has counted in: nobody else touches it
    return last


@triton.jit
def add_partials(part, slice_stride, SPLITS, bias_ptr, feature, out, mask, HAS_BIAS: tl.constexpr):
    """out = the SPLITS slices at ``part + s * slice_stride`` summed in order s = 0, 1, ... (+ bias[feature]), cast
    to out's dtype: the additions ``_split_k_reduce_kernel`` makes, so the same bits."""
    acc = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
    for _ in range(1, SPLITS):
        part += slice_stride
        acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + feature, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def store_or_reduce(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, part_offs, out_offs, feature, mask, split, tile,
                    slice_stride, SPLITS, REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A split program's epilogue: its fp32 ``acc`` to its slice ``split`` of the partials (``part_offs``: offsets
    within a slice of ``slice_stride`` = M * N elements); REDUCE: then, in the last program of output tile
    ``tile``, every slice added into ``out_ptr + out_offs`` (plus ``bias_ptr + feature``).  Without REDUCE the
    launcher adds them (``reduce_partials``)."""
    tl.store(part_ptr + part_offs + split.to(tl.int64) * slice_stride, acc, mask=mask)
    if REDUCE:
        last = last_arrival(counter_ptr, tile, SPLITS)
        if last:
            add_partials(part_ptr + part_offs, slice_stride, SPLITS, bias_ptr, feature, out_ptr + out_offs, mask,
                         HAS_BIAS)


@triton.jit
def store_row(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, m, n, n_mask, N, stride_om, split, SPLITS,
              PARTIAL: tl.constexpr, REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A GEMV program's epilogue (grid: feature tiles, rows, splits): ``acc``, the fp32 sums of features ``n`` of
    row ``m``, stored in out's dtype (plus bias); with PARTIAL, this split's slice of the [SPLITS, M, N] partials,
    which the tile's last split adds with REDUCE (``store_or_reduce``)."""
    if PARTIAL:
        store_or_reduce(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, m.to(tl.int64) * N + n,
                        m.to(tl.int64) * stride_om + n, n, n_mask, split, m * tl.num_programs(0) + tl.program_id(0),
                        tl.num_programs(1) * N, SPLITS, REDUCE, HAS_BIAS)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def store_tile(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, rm, n, m_mask, n_mask, M, N, stride_om,
               SPLIT_K: tl.constexpr, REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A GEMM program's epilogue (grid: output tiles, splits): the [BLOCK_M, BLOCK_N] fp32 ``acc`` of rows ``rm`` and
    features ``n``, stored in out's dtype (plus bias); with SPLIT_K > 1, this split's slice of the [SPLIT_K, M, N]
    partials, which the tile's last split adds with REDUCE (``store_or_reduce``)."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    else:
        store_or_reduce(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, rm.to(tl.int64)[:, None] * N + n[None, :],
                        rm.to(tl.int64)[:, None] * stride_om + n[None, :], n[None, :],
                        m_mask[:, None] & n_mask[None, :], tl.program_id(1), tl.program_id(0), M * N, SPLIT_K, REDUCE,
                        HAS_BIAS)


@triton.jit
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, stride_om, SPLITS: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """The fallback's second launch (a launch captured in a CUDA graph before the device had counters enough):
    out = the partials' slices added in order, + bias, cast."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(part_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * MN + i, mask=mask, other=0.0)
    col = i % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i // N) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=mask)



def split_count(steps: int, most: int, least: int) -> int:
    """How many ways a GEMV-like kernel splits K's ``steps``: doubling (up to ``most``) while each split keeps
    >= ``least`` steps: more programs in flight hide the latency of the loads, and narrow layers (TP shards, small
    models) need them."""
    split = 1
    while split < most and steps // (2 * split) >= least:
        split *= 2
    return split


BLOCK = 1024
CONFIG = LaunchConfig({"BLOCK": BLOCK}, num_warps=4)


@functools.lru_cache(maxsize=64)
def _options(device: torch.device) -> dict:
    return CONFIG.options(device_target(device))


def reduce_partials(partials: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out [M, N] (unit stride in N) = sum over dim 0 of partials [splits, M, N] fp32, + bias [N]."""
    splits, m, n = partials.shape
    with on_device(out.device):
        _split_k_reduce_kernel[(triton.cdiv(m * n, BLOCK),)](partials, bias if bias is not None else partials, out,
                                                             m * n, n, out.stride(0), SPLITS=splits,
                                                             HAS_BIAS=bias is not None, BLOCK=BLOCK,
                                                             **_options(out.device))



# The devices' arrival counters (all zero between launches), and the buffers they outgrew: those stay alive, as a
# CUDA graph captured with one still uses its address.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
MIN_COUNTERS = 1 << 14


def counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's int32 zero counters, at least ``tiles`` of them: made (or grown) now unless the current stream
    is capturing a CUDA graph, where None says the launch must fall back to ``reduce_partials``.  None on AMD GPUs
    too: there a workgroup barrier does not wait for the other waves' stores to complete before the one atomic's
    release (the protocol above is CUTLASS's split-K semaphore on NVIDIA), and it has not run on AMD hardware, so
    AMD keeps the second launch."""
    if _in_kernel_unproven(device):
        return None
    return held_zeros(_COUNTERS, _OUTGROWN, device, tiles, torch.int32, MIN_COUNTERS)


def held_zeros(held: dict, outgrown: list, device: torch.device, size: int, dtype: torch.dtype,
               minimum: int) -> torch.Tensor | None:
    """``held[device]``, a zero buffer of at least ``size`` elements that every launch using it leaves zero: made (or
    grown, to a power of two and at least ``minimum``) now, unless the current stream is capturing a CUDA graph
    (None).  A buffer it outgrows stays alive in ``outgrown``: a captured graph keeps the address it was captured
    with."""
    buf = held.get(device)
    if buf is not None and buf.numel() >= size:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        outgrown.append(buf)
    buf = held[device] = torch.zeros(max(minimum, triton.next_power_of_2(size)), dtype=dtype, device=device)
    return buf


@functools.lru_cache(maxsize=16)
def _in_kernel_unproven(device: torch.device) -> bool:
    target = device_target(device)
    return target is not None and target.is_amd


class SplitK(NamedTuple):
    """What a split-K launch passes its kernel, from ``split_k_buffers``."""

    partials: torch.Tensor  # the kernel's out_ptr's partner: fp32 [splits, M, N], or the output itself at split 1
    counters: torch.Tensor  # int32 arrival counters per output tile (any int32 buffer when unused)
    reduce: bool  # the kernel's REDUCE: its last program of a tile adds the partials

    def finish(self, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        """After the launch: the fallback's second launch, where the kernel wrote partials it did not add."""
        if self.partials is not out and not self.reduce:
            reduce_partials(self.partials, out, bias)


def split_k_buffers(out: torch.Tensor, splits: int, tiles: int, add_in_kernel: bool = True) -> SplitK:
    """out [M, N], K split ``splits`` ways over ``tiles`` output tiles: at split 1 the kernel stores ``out``
    directly; above, it writes fp32 partials [splits, M, N] (a fresh buffer) and, with the device's counters, adds
    them itself (REDUCE); under CUDA-graph capture without counters enough, or where the launcher's config says
    ``add_in_kernel=False`` (the path measured faster with the separate launch), ``finish`` adds them.  Call inside
    ``on_device(out.device)`` (the capture check is on the current stream)."""
    if splits == 1:
        return SplitK(out, unused_counters(out.device), False)
    partials = torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device)
    buf = counters(out.device, tiles) if add_in_kernel else None
    if buf is None:
        return SplitK(partials, unused_counters(out.device), False)
    return SplitK(partials, buf, True)


_UNUSED: dict[torch.device, torch.Tensor] = {}


def unused_counters(device: torch.device) -> torch.Tensor:
    """A 1-element int32 tensor for the counter argument of a launch that adds no partials in the kernel (so every
    launch has the cross-compiled signature), kept per device: launchers run on every decode step."""
    buf = _UNUSED.get(device)
    if buf is None:
        buf = _UNUSED[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return buf


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"part_ptr": "*fp32", "bias_ptr": f"*{t}", "out_ptr": f"*{t}", "MN": "i32", "N": "i32",
            "stride_om": "i32", "SPLITS": "constexpr", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"}


register(KernelSpec("split_k_reduce", _split_k_reduce_kernel, _signature, (torch.float16, torch.bfloat16),
                    {"default": (LaunchConfig({"SPLITS": 8, "HAS_BIAS": True, "BLOCK": BLOCK}, CONFIG.num_warps),)}))
