"""Fused elementwise ops of a decoder layer against torch eager and a plain copy of the same bytes.

SiLU-and-mul and GELU-and-mul (the MLP gates), RMSNorm with and without the residual add fused, and
rotary embedding on q and k.  Each is memory bound: it reads its inputs once and writes its outputs once,
so the copy is the bar to reach, and ``bytes`` counts exactly those reads and writes.  ``torch`` is what
a plain PyTorch model runs (HF transformers' formulas, eager).  Shapes are real models', from one decode
token to a long prefill chunk; decode-sized ones (<= 128 tokens) are timed as graph replays.

``quick`` runs the SiLU-and-mul shapes only (the harness's smoke test); the CPU runs every op at small
fp32 shapes (the PyTorch references; bf16 is emulated and slow there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops import fused_add_rms_norm, gelu_and_mul, rms_norm, rotary_embedding, silu_and_mul
from ...ops.rotary_embedding import rotary_cos_sin_cache
from ..harness import Case, suite

# (tokens, intermediate size d); x is [tokens, 2*d].  14336: Llama-3-8B and Mistral-7B; 28672: Llama-3-70B.
GPU_SHAPES = ((1, 14336), (128, 14336), (4096, 14336), (16384, 14336), (4096, 28672))
# The CPU runs the PyTorch reference; small fp32 shapes keep it quick (bf16 is emulated and slow there).
SMALL_SHAPES = ((64, 1024), (256, 2048))

TOKENS = (1, 128, 4096, 16384)
HIDDEN = (4096, 8192)  # Llama-3-8B, Llama-3-70B
GELU_D = 14336  # Gemma-2-9B's intermediate size (gelu_pytorch_tanh)
LLAMA3_8B_HEADS = (32, 8, 128)  # query heads, kv heads, head dim
SMALL_TOKENS = (16, 256)
SMALL_HEADS = (8, 2, 64)


@suite("elementwise", "fused SiLU/GELU-and-mul, RMSNorm (+residual) and rotary against torch eager and a copy")
def elementwise(device: torch.device, quick: bool) -> list[Case]:
    small = quick or device.type == "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    cases = [_silu_case(tokens, d, dtype, device) for tokens, d in (SMALL_SHAPES if small else GPU_SHAPES)]
    if quick:
        return cases
    tokens_list, hidden_list = (SMALL_TOKENS, (1024,)) if small else (TOKENS, HIDDEN)
    cases += [_rms_norm_case(t, h, dtype, device) for h in hidden_list for t in tokens_list]
    cases += [_fused_add_rms_norm_case(t, h, dtype, device) for h in hidden_list for t in tokens_list]
    gelu_d = 1024 if small else GELU_D
    cases += [_gelu_case(t, gelu_d, dtype, device) for t in tokens_list]
    heads = SMALL_HEADS if small else LLAMA3_8B_HEADS
    cases += [_rotary_case(t, *heads, dtype, device) for t in tokens_list]
    return cases


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _copy(nbytes: int, dtype: torch.dtype, device: torch.device):
    """``dst.copy_(src)`` moving ``nbytes``: it reads src and writes dst, so src is half of them."""
    src = torch.randn(nbytes // 2 // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _silu_case(tokens: int, d: int, dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(tokens, 2 * d, dtype=dtype, device=device)
    nbytes = x.nbytes + tokens * d * x.element_size()  # read x once, write out once

    def torch_eager():
        return F.silu(x[..., :d]) * x[..., d:]

    return Case(
        op="silu_and_mul",
        shape=f"{tokens}x{2 * d} {_name(dtype)}",
        ours=lambda: silu_and_mul(x),
        baselines={"torch": torch_eager, "copy": _copy(nbytes, dtype, device)},
        bytes=nbytes,
        # Decode-sized launches are bound by host time; a decode step replays them from a graph.
        graph=tokens <= 128,
    )


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF transformers' LlamaRMSNorm.forward, as a model runs it eagerly."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_norm_case(tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    nbytes = 2 * x.nbytes + weight.nbytes  # read x and the weight once, write out once
    return Case(
        op="rms_norm",
        shape=f"{tokens}x{hidden} {_name(dtype)}",
        ours=lambda: rms_norm(x, weight, 1e-5),
        baselines={"torch": lambda: hf_rms_norm(x, weight, 1e-5), "copy": _copy(nbytes, dtype, device)},
        bytes=nbytes,
        graph=tokens <= 128,
    )


def _fused_add_rms_norm_case(tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    nbytes = 4 * x.nbytes + weight.nbytes  # read x, residual and the weight, write out and the new residual

    def torch_eager():
        new_residual = x + residual
        return hf_rms_norm(new_residual, weight, 1e-5), new_residual

    return Case(
        op="fused_add_rms_norm",
        shape=f"{tokens}x{hidden} {_name(dtype)}",
        ours=lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
        baselines={"torch": torch_eager, "copy": _copy(nbytes, dtype, device)},
        bytes=nbytes,
        graph=tokens <= 128,
    )


def _gelu_case(tokens: int, d: int, dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(tokens, 2 * d, dtype=dtype, device=device)
    nbytes = x.nbytes + tokens * d * x.element_size()

    def torch_eager():
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]

    return Case(
        op="gelu_and_mul",
        shape=f"{tokens}x{2 * d} {_name(dtype)} tanh",
        ours=lambda: gelu_and_mul(x, "tanh"),
        baselines={"torch": torch_eager, "copy": _copy(nbytes, dtype, device)},
        bytes=nbytes,
        graph=tokens <= 128,
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF transformers' rotate_half (NeoX style)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary_case(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> Case:
    # q and k are views of the fused QKV projection's output, as in a model.
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    max_position = 131072 if device.type == "cuda" else 4096
    cache = rotary_cos_sin_cache(head_dim, max_position, base=500000.0, device=device,
                                 scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    positions = torch.randint(0, max_position, (tokens,), device=device)
    # q and k read and written once, plus each token's position and cache row.
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + positions.nbytes + tokens * head_dim * 4

    def torch_eager():  # HF's apply_rotary_pos_emb, with cos and sin gathered from the cache
        cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1)[:, None].to(dtype)
        sin = torch.cat((sin, sin), dim=-1)[:, None].to(dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def ours():
        rotary_embedding(positions, q, k, cache, True)
        return q, k

    return Case(
        op="rotary_embedding",
        shape=f"{tokens}x({q_heads}+{kv_heads})x{head_dim} {_name(dtype)} neox",
        ours=ours,
        baselines={"torch": torch_eager, "copy": _copy(nbytes, dtype, device)},
        bytes=nbytes,
        graph=tokens <= 128,
    )
