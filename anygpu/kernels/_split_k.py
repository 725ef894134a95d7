"""Split-K partial sums: programs that share output elements write fp32 partials to their own slice of a
[splits, M, N] buffer, and one small kernel adds the slices in a fixed order, adds the bias and casts.
Unlike atomics this is deterministic (same bits on every run) and needs no zeroed buffer."""

import functools

import torch
import triton
import triton.language as tl

from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, on_device, register


@triton.jit
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, stride_om, SPLITS: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
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


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"part_ptr": "*fp32", "bias_ptr": f"*{t}", "out_ptr": f"*{t}", "MN": "i32", "N": "i32",
            "stride_om": "i32", "SPLITS": "constexpr", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"}


register(KernelSpec("split_k_reduce", _split_k_reduce_kernel, _signature, (torch.float16, torch.bfloat16),
                    {"default": (LaunchConfig({"SPLITS": 8, "HAS_BIAS": True, "BLOCK": BLOCK}, CONFIG.num_warps),)}))
