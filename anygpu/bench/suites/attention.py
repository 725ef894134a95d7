"""Attention: prefill (``flash_attn_varlen``, ``paged_prefill``) against PyTorch's SDPA with its flash and
cuDNN backends, plus the paged decode cases of ``_decode_cases`` when that module is there.

Prefill is compute bound: a case counts the FLOPs of its two matmuls, ``4 * B * S * S * H * D``, halved
under causal masking (the masked half is never computed), and reports TFLOP/s.  SDPA gets the same
tensors, viewed as [B, H, S, D] (the layout a model hands it after its QKV projection); each SDPA
backend is a baseline of its own, left out where this torch or GPU lacks it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...ops import flash_attn_varlen, paged_prefill
from ..harness import Case, suite

# (batch, sequence length): about 16k tokens per call.  32 heads of 128: Llama-3-8B's query heads.
GPU_PREFILL = ((8, 2048), (4, 4096), (2, 8192))
GPU_HEADS, GPU_HEAD_DIM = 32, 128
# The CPU runs the PyTorch reference: small fp32 shapes keep it quick (bf16 is emulated and slow there).
SMALL_PREFILL = ((2, 128), (1, 256))
SMALL_HEADS, SMALL_HEAD_DIM = 4, 64
# Prefix caching / chunked prefill: (batch, context, new tokens, q heads, kv heads), block size 16.
GPU_PAGED = (4, 4096, 1024, 32, 8)
SMALL_PAGED = (2, 256, 64, 4, 2)
BLOCK_SIZE = 16


@suite("attention", "prefill attention (packed varlen, paged prefix) vs SDPA flash / cuDNN; paged decode")
def attention(device: torch.device, quick: bool) -> list[Case]:
    small = quick or device.type == "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    heads, head_dim = (SMALL_HEADS, SMALL_HEAD_DIM) if small else (GPU_HEADS, GPU_HEAD_DIM)
    cases = [_prefill_case(batch, seq, heads, head_dim, causal, dtype, device)
             for batch, seq in (SMALL_PREFILL if small else GPU_PREFILL) for causal in (True, False)]
    cases.append(_paged_case(*(SMALL_PAGED if small else GPU_PAGED), SMALL_HEAD_DIM if small else GPU_HEAD_DIM,
                             dtype, device))
    try:  # written separately; the suite works without it
        from ._decode_cases import decode_cases
    except ImportError:
        return cases
    return cases + list(decode_cases(device, quick))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sdpa_backends() -> dict:
    """{baseline name: SDPBackend} for the backends this torch knows."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # torch < 2.3
        return {}
    names = {"sdpa flash": "FLASH_ATTENTION", "sdpa cudnn": "CUDNN_ATTENTION"}
    return {name: getattr(SDPBackend, member) for name, member in names.items() if hasattr(SDPBackend, member)}


@functools.lru_cache(maxsize=None)
def _backend_runs(backend, dtype: torch.dtype, device: torch.device, causal: bool) -> bool:
    """Whether SDPA runs with only ``backend`` here (its kernels exist for this GPU, dtype and torch)."""
    from torch.nn.attention import sdpa_kernel

    x = torch.randn(1, 2, 64, 64, dtype=dtype, device=device)
    try:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(x, x, x, is_causal=causal)
    except RuntimeError:
        return False
    return True


def _sdpa(backend, q, k, v, causal: bool, scale: float):
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    return run


def _prefill_case(batch: int, seq: int, heads: int, head_dim: int, causal: bool, dtype: torch.dtype,
                  device: torch.device) -> Case:
    q, k, v = (torch.randn(batch * seq, heads, head_dim, dtype=dtype, device=device) for _ in range(3))
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    as_bhsd = [t.view(batch, seq, heads, head_dim).transpose(1, 2) for t in (q, k, v)]
    baselines = {name: _sdpa(backend, *as_bhsd, causal, scale) for name, backend in _sdpa_backends().items()
                 if _backend_runs(backend, dtype, device, causal)}
    flops = 4 * batch * seq * seq * heads * head_dim
    return Case(
        op="flash_attn_varlen",
        shape=f"{batch}x{seq} h{heads} d{head_dim} {'causal' if causal else 'full'} {_name(dtype)}",
        ours=lambda: flash_attn_varlen(q, k, v, cu, cu, seq, seq, scale, causal),
        baselines=baselines,
        flops=flops // 2 if causal else flops,
    )


def _paged_case(batch: int, context: int, new: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> Case:
    """``new`` tokens per sequence after a cached prefix, K/V in 16-token blocks at random places; the
    baseline is our own packed-K/V kernel on the same K/V stored contiguously (the cost of paging)."""
    per_seq = context // BLOCK_SIZE  # contexts here are whole blocks
    tables = torch.randperm(batch * per_seq, device=device).to(torch.int32).view(batch, per_seq)
    k = torch.randn(batch * context, kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
    for packed, cache in ((k, k_cache), (v, v_cache)):  # block tables[b, i] holds tokens i*16.. of sequence b
        cache.view(-1, BLOCK_SIZE, kv_heads, head_dim)[tables.flatten().long()] = packed.view(
            -1, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = (c.view(-1, BLOCK_SIZE, kv_heads, head_dim) for c in (k_cache, v_cache))
    q = torch.randn(batch * new, heads, head_dim, dtype=dtype, device=device)
    cu_q = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (batch + 1) * context, context, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    # Query row i (of `new`) sees the prefix and the new tokens up to itself.
    visible = new * (context - new) + new * (new + 1) // 2
    return Case(
        op="paged_prefill",
        shape=f"{batch}x{new}/{context} h{heads}/{kv_heads} d{head_dim} bs{BLOCK_SIZE} {_name(dtype)}",
        ours=lambda: paged_prefill(q, k_cache, v_cache, tables, cu_q, seqlens, new, context, scale),
        baselines={"packed K/V": lambda: flash_attn_varlen(q, k, v, cu_q, cu_k, new, context, scale, True)},
        flops=4 * batch * visible * heads * head_dim,
    )
