"""FlashAttention-2 forward for packed variable-length sequences (prefill).

q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]``; sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v.  One program computes BLOCK_M query rows of one head
of one sequence, streaming the sequence's keys in tiles of BLOCK_N with the online softmax (running max
``m``, running sum ``l``, fp32 accumulator), so the scores never reach memory.

Masking, for query row i of a sequence with q_len queries and k_len keys (flash-attn >= 2.1 semantics):
the row's position among the keys is ``i + k_len - q_len`` (causal is aligned bottom-right); key j is
visible iff ``j < k_len``, ``j <= pos`` when causal and ``j >= pos - window_left`` when a window is set.
Soft-capping (``s = softcap * tanh(s / softcap)``) comes before masking.  A row that sees no key
outputs 0.

The key range of a query tile is split into tiles that need no mask (the bulk) and the few at its
edges that do (the causal diagonal, the window's far edge, the ragged end of the sequence); tiles no
row can see are never visited.  The grid is ``(cdiv(max_seqlen_q, BLOCK_M), Hq, B)``: it needs only the
caller's ``max_seqlen_q``, never a value read back from the GPU, and programs past their sequence's end
exit at once.  Within a sequence the last query tile (the one that sees the most keys under causal
masking) gets the lowest program id, so it launches first and the short ones fill the tail.

The same kernel reads K/V from a paged cache through block tables (``paged_prefill``: chunked prefill and
prefix caching).  The tile loop is in ``_attention_tiles.py``; the references and the ops are
``anygpu/ops/flash_attn_varlen.py`` and ``anygpu/ops/paged_prefill.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from ._attention_tiles import attend_query_tile, load_rows, store_rows
from .launch import (TRITON_DTYPE, KernelSpec, LaunchConfig, cached_options, device_target, launch_config, on_device,
                     register, select)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors: the pointer kernel everywhere
    TensorDescriptor = None

LOG2E = math.log2(math.e)
MAX_GRID_YZ = 65535  # the CUDA and HIP limit on a grid's 2nd and 3rd dimensions (heads, sequences)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_q_ptr, seqlens_k_ptr, block_tables_ptr, block_table_stride,
                    q_stride_tok, q_stride_head, k_stride_blk, k_stride_tok, k_stride_head,
                    v_stride_blk, v_stride_tok, v_stride_head, o_stride_tok, o_stride_head,
                    group, scale, cap, window_left,
                    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, DESC: tl.constexpr = False):
    """One (query tile, head, sequence).  PAGE_SIZE == 0: packed K/V, ``seqlens_k_ptr`` is cu_seqlens_k and
    the block-table arguments are unused.  PAGE_SIZE > 0: K/V in a paged cache [blocks, PAGE_SIZE, Hkv, D]
    (``k_stride_tok`` is the slot stride), ``seqlens_k_ptr`` holds each sequence's context length.
    DESC (packed K/V, HEAD_DIM == BLOCK_D): q, k and v are tensor descriptors over [tokens, heads x D] (TMA
    copies on Hopper), and the stride arguments of q, k and v are unused."""
    seq = tl.program_id(2)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # Program 0 takes the sequence's last query tile: under causal masking it has the most work.
    m_block = tl.cdiv(q_len, BLOCK_M) - 1 - tl.program_id(0)
    if m_block < 0:
        return
    m0 = m_block * BLOCK_M
    kv_head = head // group  # GQA / MQA: `group` query heads share one K/V head
    desc_row = 0
    desc_col = 0
    if PAGE_SIZE > 0:
        tl.static_assert(not DESC)
        k_len = tl.load(seqlens_k_ptr + seq)
        k_base = k_ptr + kv_head * k_stride_head
        v_base = v_ptr + kv_head * v_stride_head
        block_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    else:
        k_start = tl.load(seqlens_k_ptr + seq)
        k_len = tl.load(seqlens_k_ptr + seq + 1) - k_start
        block_row = block_tables_ptr
        if DESC:
            tl.static_assert(HEAD_DIM == BLOCK_D)
            desc_row = k_start
            desc_col = kv_head * HEAD_DIM
            k_base = k_ptr
            v_base = v_ptr
        else:
            k_base = k_ptr + k_start.to(tl.int64) * k_stride_tok + kv_head * k_stride_head
            v_base = v_ptr + k_start.to(tl.int64) * v_stride_tok + kv_head * v_stride_head

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if DESC:
        # Rows past the sequence are the next sequence's (or zeros past the tensor): computed, never stored.
        q = q_ptr.load([q_start + m0, head * HEAD_DIM])
    else:
        q_rows = (q_start + offs_m).to(tl.int64) * q_stride_tok + head * q_stride_head
        q = load_rows(q_ptr + q_rows[:, None] + offs_d[None, :], offs_m < q_len, True, HEAD_DIM, BLOCK_D)
    out = attend_query_tile(q, k_base, v_base, k_stride_tok, v_stride_tok, block_row, k_stride_blk,
                            v_stride_blk, desc_row, desc_col, m0, q_len, k_len, scale, cap, window_left, IS_CAUSAL,
                            HAS_WINDOW, HAS_SOFTCAP, PAGE_SIZE, DESC, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D)
    o_rows = (q_start + offs_m).to(tl.int64) * o_stride_tok + head * o_stride_head
    store_rows(out_ptr + o_rows[:, None] + offs_d[None, :], out, offs_m < q_len, HEAD_DIM, BLOCK_D)


# Tiles per target and head-dim class (the head dim padded to a power of two: <= 64, 128, 256).  Each
# program keeps its accumulator (BLOCK_M x D fp32) and q tile in registers and stages K and V tiles
# (BLOCK_N x D each) in shared memory / LDS, once per pipeline stage.  Chosen from cross-compiles
# (``anygpu.kernels.aot``; no timing): shared memory within each target's per-block limit, and the
# fewest spilled registers the compiler reports.  Timing on each GPU should refine them.
# - Hopper / Blackwell (227 KiB): 128 x 128 tiles, 8 warps (two warpgroups of 64 rows), 3 stages
#   (224 KiB); at D = 256 128 x 64 and 2 stages (192 KiB).
# - sm_80 (163 KiB) and the 99 KiB Ampere / Ada parts: FA2's 128 x 64, 2-3 stages; D = 256 gets
#   128 x 64 only on sm_80.  "default" (an NVIDIA arch we have no row for) stays under 48 KiB.
# - CDNA3/4: AMD's own FA configs, 128 x 64, 4 waves, 1 stage, waves_per_eu = 2 (two programs per
#   SIMD, 256 VGPRs each); gfx90a 64 x 64 with 16x16 MFMAs (its 32x32 ones spill).  D = 256: 64 x 32
#   (larger tiles spill hundreds of VGPRs).
# - RDNA3/4 (wave32, 64 KiB LDS; WMMA operands are replicated in both half-waves, doubling their
#   registers): 8 waves on 128 x 32 / 64 x 32 tiles.  At D = 256 every tile tried spills 100-200
#   VGPRs; 32 x 32 with 16 waves spills least.
def _cfg(block_m, block_n, num_warps, num_stages=None, waves_per_eu=None, nonkdim=None):
    return (LaunchConfig({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages,
                         waves_per_eu=waves_per_eu, matrix_instr_nonkdim=nonkdim),)


_BIG_NVIDIA = {64: _cfg(128, 128, 8, 3), 128: _cfg(128, 128, 8, 3), 256: _cfg(128, 64, 8, 2)}
_AMPERE = {64: _cfg(128, 64, 4, 3), 128: _cfg(128, 64, 8, 2), 256: _cfg(64, 32, 4, 2)}
_CDNA = {64: _cfg(128, 64, 4, 1, 2), 128: _cfg(128, 64, 4, 1, 2), 256: _cfg(64, 32, 4, 1, 2)}
_RDNA = {64: _cfg(128, 32, 8, 1), 128: _cfg(64, 32, 8, 1), 256: _cfg(32, 32, 16, 1)}
CONFIGS = {
    dim: {"default": {64: _cfg(64, 64, 4, 2), 128: _cfg(64, 32, 4, 2), 256: _cfg(32, 32, 4, 1)}[dim],
          "hopper": _BIG_NVIDIA[dim], "blackwell": _BIG_NVIDIA[dim], "ampere": _AMPERE[dim], "ada": _AMPERE[dim],
          "sm_80": _cfg(128, 64, 8, 2) if dim == 256 else _AMPERE[dim],
          "amd": _cfg(64, 32, 4, 1), "cdna3": _CDNA[dim], "cdna4": _CDNA[dim],
          "cdna2": {64: _cfg(64, 64, 4, 1, 2), 128: _cfg(64, 64, 4, 1, 2, 16), 256: _cfg(64, 32, 4, 1, 2)}[dim],
          "rdna3": _RDNA[dim], "rdna4": _RDNA[dim]}
    for dim in (64, 128, 256)
}

# float32 (the ops take it; the CPU's dtype): no tensor-core dot keeps IEEE fp32 on NVIDIA, and its tiles
# take twice the bytes, so small tiles everywhere (at D = 256: 48 KiB on Ampere / Hopper, 16 KiB on CDNA).
FP32_CONFIGS = {dim: {"default": _cfg(16, 16, 4, 1) if dim == 256 else _cfg(32, 32, 4, 1)} for dim in (64, 128, 256)}

DTYPES = (torch.float16, torch.bfloat16)  # cross-compiled; the launcher also takes float32


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two (masked loads and stores cover the padding); >= 16 for tl.dot."""
    return max(16, 1 << (head_dim - 1).bit_length())


def configs_for(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The per-target config table for this head dim's class and dtype."""
    return (FP32_CONFIGS if dtype == torch.float32 else CONFIGS)[max(64, block_d(head_dim))]


def aot_table(head_dim: int, causal: bool = True, window: bool = False, softcap: bool = False,
              page_size: int = 0, desc: bool = False) -> dict:
    """``configs_for(head_dim)`` (``desc``: ``TMA_CONFIGS``) with every constexpr of the kernel bound, for
    cross-compilation; launcher-only keys (MAX_Q) dropped."""
    bound = {"IS_CAUSAL": causal, "HAS_WINDOW": window, "HAS_SOFTCAP": softcap, "PAGE_SIZE": page_size,
             "HEAD_DIM": head_dim, "BLOCK_D": block_d(head_dim), "DESC": desc}
    table = TMA_CONFIGS if desc else configs_for(head_dim)
    return {key: tuple(replace(c, constexprs={**{n: x for n, x in c.constexprs.items() if n != "MAX_Q"}, **bound})
                       for c in cfgs) for key, cfgs in table.items()}


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    sig = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "out_ptr": f"*{t}", "cu_seqlens_q_ptr": "*i32",
           "seqlens_k_ptr": "*i32", "block_tables_ptr": "*i32", "block_table_stride": "i32"}
    sig.update(dict.fromkeys(("q_stride_tok", "q_stride_head", "k_stride_blk", "k_stride_tok", "k_stride_head",
                              "v_stride_blk", "v_stride_tok", "v_stride_head", "o_stride_tok", "o_stride_head",
                              "group"), "i32"))
    sig.update({"scale": "fp32", "cap": "fp32", "window_left": "i32"})
    sig.update(dict.fromkeys(("IS_CAUSAL", "HAS_WINDOW", "HAS_SOFTCAP", "PAGE_SIZE", "HEAD_DIM", "BLOCK_M", "BLOCK_N",
                              "BLOCK_D", "DESC"), "constexpr"))
    return sig


def _tma_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {**_signature(dtype), "q_ptr": f"tensordesc<{t}[{{BLOCK_M}}, {TMA_HEAD_DIM}]>",
            "k_ptr": f"tensordesc<{t}[{{BLOCK_N}}, {TMA_HEAD_DIM}]>", "v_ptr": f"tensordesc<{t}[{{BLOCK_N}}, {TMA_HEAD_DIM}]>"}


class AttentionSpec(KernelSpec):
    def attrs(self, dtype: torch.dtype) -> dict:
        """Divisibility hints on pointers and strides only, as the runtime sees them for aligned tensors and
        LLM shapes; the float scales take none, and the GQA group and the window are small numbers."""
        sig = self.signature(dtype)
        return {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(sig.items())
                if kind.startswith("*") or "stride" in name}


# Cross-compiled for every CI target: the prefill that runs most, packed K/V, causal, head dim 128.  The
# paged variant and head dim 256 on the 64 KiB-LDS targets are compiled by tests/test_flash_attention.py
# (each variant costs another two dozen compiles here).
SPEC = register(AttentionSpec("flash_attention", _prefill_kernel, _signature, DTYPES, aot_table(128)))


# ---- the tensor-descriptor (TMA) variant: packed K/V on Hopper ----------------------------------------------
# q, k and v reach the kernel as descriptors over [tokens, heads x D], so every K/V tile is one TMA copy with no
# per-element address arithmetic.  Measured on the H200 against the pointer kernel's 128 x 128 tiles (causal, bf16,
# 32 heads of 128, docs/perf/2026-12-02-prefill-attention-tma.md): 64 x 64 tiles with 4 warps, two programs an SM,
# +10 % at 8 x 2048 tokens and even at 4 x 4096; at 2 x 8192 the 128 x 128 tiles, +3.5 %.  The pointer kernel
# with 64 x 64 tiles lost 10-15 % to it.  Only head dim 128 was measured, so only 128 takes it; other targets
# (no TMA, or not measured) keep the pointer kernel.  MAX_Q: the longest query sequence a config takes.
TMA_HEAD_DIM = 128
TMA_CONFIGS = {
    "default": (),
    "hopper": (LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 64, "MAX_Q": 4096}, num_warps=4, num_stages=3),
               LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 128, "MAX_Q": None}, num_warps=8, num_stages=3)),
}


def _descriptor_ready(t: torch.Tensor) -> bool:
    """[tokens, heads, D] readable as a [tokens, heads x D] descriptor: heads contiguous and rows starting on
    16-byte boundaries (TMA's rule for the base and the row stride)."""
    return (t.shape[0] > 0 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) % 8 == 0
            and t.data_ptr() % 16 == 0)


def tma_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int) -> LaunchConfig | None:
    """The tensor-descriptor config for this call, or None where the pointer kernel runs it."""
    if (TensorDescriptor is None or q.device.type != "cuda" or q.dtype not in DTYPES
            or q.shape[-1] != TMA_HEAD_DIM or not all(_descriptor_ready(t) for t in (q, k, v))):
        return None
    configs = select(TMA_CONFIGS, device_target(q.device))
    fits = [c for c in configs if c.constexprs["MAX_Q"] is None or max_seqlen_q <= c.constexprs["MAX_Q"]]
    return fits[0] if fits else None


def _tma_descriptors(q, k, v, block_m: int, block_n: int) -> tuple:
    d = q.shape[-1]
    return tuple(TensorDescriptor(t, [t.shape[0], t.shape[1] * d], [t.stride(0), 1], [rows, d])
                 for t, rows in ((q, block_m), (k, block_n), (v, block_n)))


TMA_SPEC = register(AttentionSpec("flash_attention_tma", _prefill_kernel, _tma_signature, DTYPES,
                                  aot_table(TMA_HEAD_DIM, desc=True)))


def scales(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """The kernel's (scale, cap): scores in log2 units, so the softmax is one exp2 per element."""
    if softcap > 0:
        return softmax_scale / softcap, softcap * LOG2E
    return softmax_scale * LOG2E, 0.0


def _launch(q, k, v, out, cu_seqlens_q, seqlens_k, block_tables, k_strides, v_strides, max_seqlen_q, softmax_scale,
            causal, window_left, softcap, page_size, tma: LaunchConfig | None = None):
    num_seqs = cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or num_seqs <= 0 or max_seqlen_q <= 0:
        return out.zero_()  # no query rows in any sequence: the reference's zeros
    if num_seqs > MAX_GRID_YZ or q.shape[1] > MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q, q: expected at most {MAX_GRID_YZ} sequences and {MAX_GRID_YZ} heads per "
                         f"launch, got {num_seqs} and {q.shape[1]}")
    total_q, num_heads, head_dim = q.shape
    if tma is not None:
        cfg, options = tma, cached_options(tma, q.device)
    else:
        cfg, options = launch_config(configs_for(head_dim, q.dtype), q.device)
    block_m, block_n = cfg.constexprs["BLOCK_M"], cfg.constexprs["BLOCK_N"]
    scale, cap = scales(softmax_scale, softcap)
    grid = (-(-max_seqlen_q // block_m), num_heads, num_seqs)
    cu_seqlens_q, seqlens_k = cu_seqlens_q.contiguous(), seqlens_k.contiguous()  # read with stride 1
    with on_device(q.device):
        qd, kd, vd = _tma_descriptors(q, k, v, block_m, block_n) if tma is not None else (q, k, v)
        _prefill_kernel[grid](
            qd, kd, vd, out, cu_seqlens_q, seqlens_k, block_tables, block_tables.stride(0), q.stride(0), q.stride(1),
            *k_strides, *v_strides, out.stride(0), out.stride(1), num_heads // k.shape[-2], scale, cap, window_left,
            IS_CAUSAL=bool(causal), HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, PAGE_SIZE=page_size,
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d(head_dim), DESC=tma is not None,
            **options)
    return out


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                      causal: bool, window_left: int = -1, softcap: float = 0.0,
                      tma: LaunchConfig | bool | None = None) -> torch.Tensor:
    """Launch on q's device (a GPU, or the CPU under TRITON_INTERPRET=1).  Arguments as the op's
    (``anygpu/ops/flash_attn_varlen.py``, which checks them).  ``max_seqlen_q`` must be at least the
    longest query length (it sizes the grid); ``max_seqlen_k`` is not needed.  ``tma``: None picks the
    tensor-descriptor kernel where ``tma_config`` has one, False never does, a config forces it (tests: q, k and
    v must then be ``_descriptor_ready`` with the head dim a power of two)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cfg = tma_config(q, k, v, max_seqlen_q) if tma is None else (tma or None)
    return _launch(q, k, v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k, (0, k.stride(0), k.stride(1)),
                   (0, v.stride(0), v.stride(1)), max_seqlen_q, softmax_scale, causal, window_left, softcap, 0, cfg)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  softmax_scale: float, window_left: int = -1, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of the new queries of each sequence (its last q_len positions) over its whole
    context in a paged cache [num_blocks, block_size, Hkv, D].  Arguments as the op's
    (``anygpu/ops/paged_prefill.py``); the caches' last dimension must be contiguous (not copied: they
    are the whole KV cache)."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache, v_cache: expected a contiguous last dimension (stride 1)")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _launch(q, k_cache, v_cache, out, cu_seqlens_q, seqlens_k, block_tables, k_cache.stride()[:3],
                   v_cache.stride()[:3], max_seqlen_q, softmax_scale, True, window_left, softcap, k_cache.shape[1])
