"""``flash_attn_varlen``: attention over packed variable-length sequences (prefill), flash-attn's varlen API.

q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]`` (Hq a multiple of Hkv: GQA / MQA); sequence b owns q rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and k/v rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (int32, [B+1]).
``max_seqlen_q`` must be at least the longest query length: it sizes the kernel's grid, so the GPU path
never reads a length back from the device.  Query row i of a sequence with q_len queries and k_len keys
sits at key position ``i + k_len - q_len`` (causal masking is aligned bottom-right, as flash-attn >= 2.1
does), and sees key j iff ``j <= pos`` (when ``causal``) and ``j >= pos - window_left`` (when
``window_left >= 0``).  ``softcap > 0`` caps the scaled scores, ``s = softcap * tanh(s / softcap)``, before
masking.  A row that sees no key outputs 0.  Forward only (no autograd formula).

Ops are called positionally: ``flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)``, with
``window_left`` and ``softcap`` optional at the end.  Kernel: ``anygpu/kernels/flash_attention.py``.
Numerics: the reference computes in fp32 and rounds once to q's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
QUERY_CHUNK = 1024  # rows of scores the soft-capped reference materialises at a time (bounds its memory)


def expect_int32_vector(name: str, t, device: torch.device, length: int | None = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a 1-D int32 tensor, got {got}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries, got {t.shape[0]}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on q's device {device}, got {t.device}")


def check_heads(q: torch.Tensor, k, v, k_name: str, v_name: str, k_dims: int) -> None:
    """q ``[total_q, Hq, D]``; k and v of rank ``k_dims`` ending in ``[Hkv, D]``, with q's dtype and device."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected a 3-D tensor [total_q, num_heads, head_dim], got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    head_dim = q.shape[2]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected a head dim between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    for name, t in ((k_name, k), (v_name, v)):
        if not isinstance(t, torch.Tensor) or t.dim() != k_dims:
            raise ValueError(f"{name}: expected a {k_dims}-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {t.device}")
        if t.shape[-1] != head_dim:
            raise ValueError(f"{name}: expected q's head dim {head_dim}, got {t.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"{v_name}: expected the shape of {k_name} {tuple(k.shape)}, got {tuple(v.shape)}")
    num_kv_heads = k.shape[-2]
    if num_kv_heads == 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"{k_name}: expected a number of K/V heads dividing q's {q.shape[1]} heads, "
                         f"got {num_kv_heads}")


def _is_int(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)  # SymInt: under torch.compile


def check_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, softcap) -> None:
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(value) or (isinstance(value, int) and value < 0):
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale!r}")
    if not _is_int(window_left) or (isinstance(window_left, int) and window_left < -1):
        raise ValueError(f"window_left: expected an int >= 0, or -1 for no window, got {window_left!r}")
    if not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: expected a finite float >= 0 (0: no soft-capping), got {softcap!r}")


def check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
          window_left=-1, softcap=0.0) -> None:
    """Shapes, dtypes and devices only: never a value of a device tensor (that would wait for the GPU)."""
    check_heads(q, k, v, "k", "v", 3)
    expect_int32_vector("cu_seqlens_q", cu_seqlens_q, q.device)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q: expected B+1 >= 1 entries (a leading 0), got none")
    expect_int32_vector("cu_seqlens_k", cu_seqlens_k, q.device, cu_seqlens_q.shape[0])
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    check_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, softcap)


def visible_keys(q_len: int, k_len: int, causal: bool, window_left: int, device) -> torch.Tensor:
    """[q_len, k_len] bool: which keys each query row sees (causal aligned bottom-right)."""
    pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    j = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible &= j <= pos
    if window_left >= 0:
        visible &= j >= pos - window_left
    return visible


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
               window_left: int, softcap: float) -> torch.Tensor:
    """One sequence in fp32: q ``[q_len, Hq, D]``, k/v ``[k_len, Hkv, D]`` -> ``[q_len, Hq, D]``."""
    q_len, num_heads, _ = q.shape
    k_len = k.shape[0]
    out = q.new_zeros(q.shape, dtype=torch.float32)
    if q_len == 0 or k_len == 0:
        return out
    group = num_heads // k.shape[1]
    qh = q.float().transpose(0, 1)  # [Hq, q_len, D]
    kh = k.float().transpose(0, 1).repeat_interleave(group, 0)
    vh = v.float().transpose(0, 1).repeat_interleave(group, 0)
    if softcap == 0 and window_left < 0 and (not causal or q_len == k_len):
        # SDPA's own masking is the same here (its causal is aligned top-left, which equals bottom-right
        # for as many queries as keys), and lets it pick a fused kernel; every row sees a key.
        oh = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=softmax_scale)
        return out.copy_(oh.transpose(0, 1))
    visible = visible_keys(q_len, k_len, causal, window_left, q.device)
    if softcap == 0:
        oh = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=softmax_scale)
    else:
        oh = torch.empty_like(qh)
        for start in range(0, q_len, QUERY_CHUNK):
            rows = slice(start, start + QUERY_CHUNK)
            s = softcap * torch.tanh(qh[:, rows] @ kh.transpose(1, 2) * (softmax_scale / softcap))
            p = torch.softmax(s.masked_fill(~visible[rows], float("-inf")), dim=-1)
            oh[:, rows] = p @ vh
    # Rows that see no key: 0, where a softmax over nothing gives NaN.
    return out.copy_(oh.transpose(0, 1)).masked_fill_(~visible.any(1)[:, None, None], 0.0)


def reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              window_left=-1, softcap=0.0) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # the reference may wait for the GPU
    for b in range(len(starts_q) - 1):
        rows = slice(starts_q[b], starts_q[b + 1])
        keys = slice(starts_k[b], starts_k[b + 1])
        out[rows] = attend_one(q[rows], k[keys], v[keys], softmax_scale, causal, window_left, softcap)
    return out.to(q.dtype)


def fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left=-1,
         softcap=0.0) -> torch.Tensor:
    return q.new_empty(q.shape)


flash_attn_varlen = define_op(
    "flash_attn_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
    "int max_seqlen_k, float softmax_scale, bool causal, int window_left=-1, float softcap=0.0) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="flash_attention:flash_attn_varlen",
)
