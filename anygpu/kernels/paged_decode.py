"""Decode attention over the paged KV cache (one query token per sequence), with split-KV for long contexts.

Decode is bound by reading the cache: each sequence's K and V are read once per step and there is almost no
arithmetic per byte.  The design follows from that:

- One program per (sequence, KV head[, split]) serves all Hq/Hkv query heads of its KV head: the group's
  query rows, padded to 16 for ``tl.dot``, are multiplied against each KV tile, so every cache byte is read
  once whatever the GQA ratio.  The padding rows cost tensor-core work only, which is idle here.
- A KV tile is TILE_N tokens gathered through the block table from several cache blocks.  Layout
  [num_blocks, block_size, Hkv, D]: one token's D values for a head are contiguous, so every row of the tile
  is one 16-byte-vectorised run, and block ids are int64 (a cache can pass 2**31 elements).
- Online softmax in fp32 with exp2 (the scale folded with log2(e)), fp32 accumulation.
- Split-KV (flash-decoding): when batch x Hkv programs cannot fill the GPU, each sequence's context is cut
  into partitions (a multiple of the tile and the block size); each split writes its normalised partial
  output and log2-sum-exp (fp32) to a workspace.  The split count is ``plan_splits``, a pure function of
  batch, Hkv, max_seqlen and the GPU's CU count; each program cuts its own sequence's keys into that many
  equal partitions of whole granules (a short sequence fills only the first few: with the combine below the
  others write nothing and are not waited for, so a graph captured for a long context, with many splits, costs
  a short sequence only the splits it fills).
- The splits are combined in the same launch: each split program then counts itself in on an int32 counter of
  its (sequence, KV head) (``_split_k.last_arrival``: barrier, acq_rel atomic at GPU scope), and the program
  that arrives last (of the splits that hold keys) reads their partials with ``.cg`` loads, combines them
  (``_merge_splits``) and stores the output, then leaves the counter at 0 for the next launch (and a CUDA
  graph's next replay): one launch per layer instead of two, and no program waits.  The combine runs
  elementwise, one split at a time in the order 0 .. n-1, so its bits depend neither on which program arrives
  last nor on how a kernel lays out its registers: deterministic, and the same bits as the fallback.
  Fallback: a launch captured in a CUDA graph before the device had its counters, and every launch on AMD GPUs
  (``_split_k.counters`` is None there: its docstring says why), writes the partials only, and
  ``_paged_decode_reduce_kernel`` combines them in a second launch, with the same helper.
- On targets with programmatic dependent launch (Hopper on) the splits write their partials only and
  ``paged_decode_combine.py`` combines them in a second, wide launch that starts while this one drains: at
  batch 1 the in-launch combine's walk over the splits, one after another, is what keeps a long context
  from copy bandwidth (measured: docs/perf/2026-12-07-s36.md).  Every launch there, eager or captured, with or
  without ``ANYGPU_PDL=0``, takes that path.
- No host synchronisation: the grid comes from shapes and the caller's ``max_seqlen``; each program reads
  its own sequence length, so a max_seqlen above the true one (a decode graph's) costs no speed, and a low one
  never costs correctness.

The reference and the op live in ``anygpu/ops/paged_decode.py``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._pdl import pdl_args, target_supports_pdl, wait_then_release
from ._split_k import counters, last_arrival, unused_counters
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, launch_config, on_device, register
from .paged_decode_combine import combine_splits

LOG2E = 1.4426950408889634
# Triton picks interpreter or compiler from this variable when a kernel is decorated; so do we.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
# The combine of the splits: MERGE_BLOCK output elements at a time (4 per thread with 4 warps: one 16-byte load
# per split), MERGE_UNROLL splits per loop step, whose loads do not depend on the running sums and so are all in
# flight together: the combine waits on memory about n / MERGE_UNROLL times, not n.
MERGE_BLOCK = tl.constexpr(512)
MERGE_UNROLL = tl.constexpr(8)


@triton.jit
def _dot(a, b):
    if _INTERPRETED:
        # The interpreter (3.6 and 3.9) multiplies bf16 bit patterns as integers.  In fp32 the products of
        # 16-bit floats are exact, as in the tensor cores, so the numerics are those of the GPU's MMA.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        # "ieee": fp32 inputs must not drop to tf32 on NVIDIA; fp16/bf16 are unaffected.
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tanh(x):
    # libdevice's tanh does not run in the interpreter.  Odd symmetry keeps exp's argument <= 0 (no overflow).
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, tile, lo, hi, table, k_head, v_head, dims, dim_mask, kc_stride_block,
                 kc_stride_slot, vc_stride_block, vc_stride_slot, scale_log2, softcap_scale, softcap_log2,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr):
    """One online-softmax step over keys [tile, tile + TILE_N) clipped to [lo, hi)."""
    n = tile + tl.arange(0, TILE_N)
    live = (n >= lo) & (n < hi)
    # Table entries past the sequence may be garbage: masked, never dereferenced.
    block = tl.load(table + n // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    slot_row = n % BLOCK_SIZE
    kv_mask = live[:, None] & dim_mask[None, :]
    k = tl.load(k_head + (block * kc_stride_block + slot_row * kc_stride_slot)[:, None] + dims[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_head + (block * vc_stride_block + slot_row * vc_stride_slot)[:, None] + dims[None, :],
                mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k))
    if USE_SOFTCAP:
        s = _tanh(s * softcap_scale) * softcap_log2
    else:
        s = s * scale_log2
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: no NaN
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, lo, hi, num_splits, used, HEAD_DIM: tl.constexpr):
    """Output elements [lo, hi) of the flat [batch * num_q_heads * HEAD_DIM] output, from the first ``used`` of
    the num_splits partials of their rows (the rest hold no key: lse -inf, weight 0, so leaving them out changes
    no bit): an online softmax over the splits' log2-sum-exps, one split at a time in order.
    Every operation is per element (no reduction across a tile, whose order would follow the register
    layout), so the in-kernel combine and the fallback's launch give the same bits.  ``.cg`` loads: the other
    programs' partials are read from L2 (L1 is not coherent across SMs)."""
    # while, not for: see the note in _paged_decode_kernel.
    start = lo
    while start < hi:
        e = start + tl.arange(0, MERGE_BLOCK)
        mask = e < hi
        row = e // HEAD_DIM  # batch * num_q_heads + head
        lse_at = part_lse_ptr + row * num_splits
        part_at = part_out_ptr + row * num_splits * HEAD_DIM + e % HEAD_DIM
        m = tl.full([MERGE_BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([MERGE_BLOCK], tl.float32)
        acc = tl.zeros([MERGE_BLOCK], tl.float32)
        s = 0
        while s < used:
            for u in tl.static_range(MERGE_UNROLL):
                # (a block-shaped condition: the interpreter's mask cannot be a scalar and'ed into a block)
                live = mask & (tl.full([MERGE_BLOCK], s + u, tl.int32) < used)
                lse = tl.load(lse_at + (s + u), mask=live, other=float("-inf"), cache_modifier=".cg")
                part = tl.load(part_at + (s + u) * HEAD_DIM, mask=live, other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, lse)
                m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys yet (an empty split): no NaN
                alpha = tl.exp2(m - m_base)
                w = tl.exp2(lse - m_base)
                total = total * alpha + w
                acc = acc * alpha + w * part
                m = m_new
            s += MERGE_UNROLL
        o = tl.div_rn(acc, tl.where(total == 0.0, 1.0, total))  # every split empty (seqlen 0): output 0
        tl.store(out_ptr + e, o.to(out_ptr.dtype.element_ty), mask=mask)
        start += MERGE_BLOCK


# merge (0 or 1) is not specialised: the capture fallback runs the kernel the warm-up compiled, not a new one.
@triton.jit(do_not_specialize=["merge"])
def _paged_decode_kernel(q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seqlens_ptr, out_ptr,
                         part_out_ptr, part_lse_ptr, counter_ptr, scale_log2, softcap_scale, softcap_log2,
                         window_left, group, num_q_heads, granule, num_splits, merge, q_stride_b, q_stride_h,
                         kc_stride_block, kc_stride_slot, kc_stride_head, vc_stride_block, vc_stride_slot,
                         vc_stride_head, bt_stride_b, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                         USE_SOFTCAP: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(seqlens_ptr + b)
    # Keys [lo, hi) of this program: its partition of this sequence's own keys (from the window's first tile
    # to seqlen) in num_splits equal runs of whole granules.  Cut by the sequence's length, not by the grid's
    # max_seqlen: a decode graph is captured for the longest context, and a short sequence must still spread
    # its few tiles over the splits instead of leaving them all to the first.
    first_key = tl.where(window_left >= 0, tl.maximum(seqlen - 1 - window_left, 0), 0)
    span_lo = first_key // granule * granule
    part = tl.cdiv(tl.cdiv(seqlen - span_lo, num_splits), granule) * granule
    start = span_lo + split * part
    hi = tl.minimum(start + part, seqlen)
    lo = tl.maximum(start, first_key)
    # The splits that hold keys are the first ``used`` (at least one, so a sequence without keys still writes its
    # zeros); with the in-launch combine the others write nothing and count in nowhere, so a graph captured for a
    # long context (many splits) costs a short sequence only the splits it fills.
    used = tl.maximum(tl.where(part > 0, tl.cdiv(seqlen - span_lo, tl.maximum(part, 1)), 0), 1)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_heads = kv_head * group + rows
    row_mask = rows < group
    dim_mask = dims < HEAD_DIM  # HEAD_DIM is constexpr: constant over runs of 16, so loads stay vectorised
    q = tl.load(q_ptr + b * q_stride_b + q_heads[:, None] * q_stride_h + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + b * bt_stride_b
    k_head = key_cache_ptr + kv_head * kc_stride_head
    v_head = value_cache_ptr + kv_head * vc_stride_head
    # Tiles start on a TILE_N boundary (partitions are multiples of TILE_N), so every tile holds a live key.
    first_tile = lo // TILE_N * TILE_N
    if _INTERPRETED:
        # triton 3.6's interpreter cannot run a for loop with run-time bounds under numpy 2 (it calls int()
        # on a 1-element array); a while loop runs in both.  Compiled, only scf.for loops are pipelined.
        tile = first_tile
        while tile < hi:
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, lo, hi, table, k_head, v_head, dims, dim_mask,
                                         kc_stride_block, kc_stride_slot, vc_stride_block, vc_stride_slot,
                                         scale_log2, softcap_scale, softcap_log2, BLOCK_SIZE, TILE_N, USE_SOFTCAP)
            tile += TILE_N
    else:
        for tile in range(first_tile, hi, TILE_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, lo, hi, table, k_head, v_head, dims, dim_mask,
                                         kc_stride_block, kc_stride_slot, vc_stride_block, vc_stride_slot,
                                         scale_log2, softcap_scale, softcap_log2, BLOCK_SIZE, TILE_N, USE_SOFTCAP)

    out_mask = row_mask[:, None] & dim_mask[None, :]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no key (seqlen 0, or an empty split): output 0
    o = tl.div_rn(acc, l_safe[:, None])  # IEEE division: "/" is approximate (2 ulp) on NVIDIA; this runs once
    if num_splits == 1:
        out_rows = b * num_q_heads + q_heads
        tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    elif (split < used) | (merge == 0):  # a second launch (merge 0) reads every split's partial
        part_rows = (b * num_q_heads + q_heads) * num_splits + split
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], o, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part_rows, lse, mask=row_mask)
        if merge:
            # The used splits count in; the last of them combines the group's rows from their partials.
            last = last_arrival(counter_ptr, b * tl.num_programs(1) + kv_head, used)
            if last:
                first = (b * num_q_heads + kv_head * group) * HEAD_DIM
                _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, first, first + group * HEAD_DIM, num_splits,
                              used, HEAD_DIM)


@triton.jit
def _paged_decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, numel, HEAD_DIM: tl.constexpr):
    """The fallback's second launch (a decode step captured before the device had counters): MERGE_BLOCK
    output elements per program."""
    lo = tl.program_id(0).to(tl.int64) * MERGE_BLOCK
    _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, lo, tl.minimum(lo + MERGE_BLOCK, numel), num_splits,
                  num_splits, HEAD_DIM)


# --- split planning: a pure function, unit-tested -------------------------------------------------------

MIN_PARTITION = 512  # tokens per split of a long context at least
# Split only when batch x KV heads programs are fewer than SPLIT_BELOW per CU, and then into as many partitions
# as bring the grid to about FILL per CU (rounded down): on the H200 few long sequences read their cache at
# 69 % of copy bandwidth with 2 programs per CU and 75-91 % with 4 (docs/perf/2026-12-01-paged-decode-splits.md),
# while 4 per CU unsplit (64 sequences) already run at copy bandwidth and a split only adds the reduce.
SPLIT_BELOW = 2
FILL = 4
# A short max_seqlen (a few hundred to a few thousand tokens) still splits, into up to SHORT_SPLITS partitions of
# at least SHORT_PARTITION tokens, from SHORT_FROM tokens on: a single program walks its tiles one DRAM round
# trip after another, so a few hundred tokens take about twice as long in one program as in 8, while below
# SHORT_FROM the combine costs more than it saves (docs/perf/2026-12-05-gpu-s17.md).
SHORT_PARTITION = 64
SHORT_SPLITS = 16
SHORT_FROM = 256

@dataclass(frozen=True)
class SplitPlan:
    num_splits: int  # 1: the single-pass kernel writes the output directly
    # tokens per split of a max_seqlen-long sequence, a multiple of the granule (0 when num_splits == 1); the
    # kernel cuts each sequence's own keys into num_splits partitions
    partition_size: int


def fixed_splits(max_seqlen: int, num_splits: int, granule: int) -> SplitPlan:
    """About ``num_splits`` equal partitions of ``max_seqlen`` tokens, each a multiple of ``granule``."""
    if num_splits <= 1 or max_seqlen <= granule:
        return SplitPlan(1, 0)
    per_split = -(-max_seqlen // num_splits)
    partition = -(-per_split // granule) * granule
    splits = -(-max_seqlen // partition)
    return SplitPlan(splits, partition) if splits > 1 else SplitPlan(1, 0)


def plan_splits(batch: int, num_kv_heads: int, max_seqlen: int, num_cus: int, granule: int) -> SplitPlan:
    """Split each sequence only when batch x num_kv_heads programs are fewer than SPLIT_BELOW per CU, into
    about FILL per CU in all, none shorter than MIN_PARTITION tokens, or (from SHORT_FROM tokens) up to
    SHORT_SPLITS of at least SHORT_PARTITION."""
    programs = batch * num_kv_heads
    if programs == 0 or programs >= SPLIT_BELOW * num_cus:
        return SplitPlan(1, 0)
    wanted = max(2, FILL * num_cus // programs)
    cap = max_seqlen // MIN_PARTITION
    if max_seqlen >= SHORT_FROM:
        cap = max(cap, min(max_seqlen // SHORT_PARTITION, SHORT_SPLITS))
    return fixed_splits(max_seqlen, min(wanted, cap), granule)


# --- configs --------------------------------------------------------------------------------------------

# The launcher sets HEAD_DIM, HEAD_DIM_PAD, GROUP_PAD, BLOCK_SIZE and USE_SOFTCAP from the call; in the
# tables they are the shape CI cross-compiles (the engine's default: block 16, GQA, head dim 128 or 256).
_AOT_SHAPE = {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "GROUP_PAD": 16, "BLOCK_SIZE": 16, "USE_SOFTCAP": False}
_AOT_SHAPE_D256 = {**_AOT_SHAPE, "HEAD_DIM": 256, "HEAD_DIM_PAD": 256}


def _decode(shape: dict, tile: int, **kw) -> tuple:
    return (LaunchConfig({**shape, "TILE_N": tile}, **kw),)


# head_dim <= 128.  NVIDIA: 64-token tiles (16 KiB of K and of V per tile at D=128, bf16), num_stages=3: the
# block-table entries are prefetched two tiles ahead and K/V one tile ahead with cp.async; several programs
# per SM keep enough bytes in flight.  CDNA: 32-token tiles keep the kernel near 110 VGPRs, four waves per
# SIMD (four programs per CU) without a hint; waves_per_eu=4 would only pin that, and would make fp32 (twice
# the registers per tile) spill; 16x16 MFMA for the 16-row query group; num_stages=1 as AMD's Triton
# pipeliner wants.  RDNA (wave32, WMMA
# operands replicated across the wave): 16-token tiles, the largest without spills.  "default" is the
# interpreter's: small tiles, so short test contexts still run several tiles.
CONFIGS = {
    "default": _decode(_AOT_SHAPE, 16),
    "nvidia": _decode(_AOT_SHAPE, 64, num_warps=4, num_stages=3),
    "amd": _decode(_AOT_SHAPE, 32, num_warps=4, num_stages=1, matrix_instr_nonkdim=16),
    "rdna3": _decode(_AOT_SHAPE, 16, num_warps=4, num_stages=1),
    "rdna4": _decode(_AOT_SHAPE, 16, num_warps=4, num_stages=1),
}

# head_dim 129..256: half the tile, so K, V and the query group stay in registers and well inside 64 KiB
# of LDS (8-16 KiB here).  On RDNA the replicated WMMA operands of a 256-wide query still spill some
# VGPRs at any tile size (48 with 16 warps, 88 with 4); 16 warps spill least.
LARGE_HEAD_CONFIGS = {
    "default": _decode(_AOT_SHAPE_D256, 16),
    "nvidia": _decode(_AOT_SHAPE_D256, 32, num_warps=4, num_stages=3),
    "amd": _decode(_AOT_SHAPE_D256, 16, num_warps=4, num_stages=1, matrix_instr_nonkdim=16),
    "rdna3": _decode(_AOT_SHAPE_D256, 16, num_warps=16, num_stages=1),
    "rdna4": _decode(_AOT_SHAPE_D256, 16, num_warps=16, num_stages=1),
}

REDUCE_CONFIGS = {"default": (LaunchConfig({"HEAD_DIM": 128}, num_warps=4),)}

# The launcher takes fp16, bf16 and fp32.  CI cross-compiles, to stay under a minute on two cores, the
# 16-bit dtypes decode runs in (fp32 is the same code with wider loads, compiled on first use), and at head
# dim 256, whose check is LDS and registers, bf16 only (fp16 differs in the MMA instruction's type alone).
AOT_DTYPES = (torch.float16, torch.bfloat16)
AOT_DTYPES_D256 = (torch.bfloat16,)

_INTS = ("window_left", "group", "num_q_heads", "granule", "num_splits", "merge", "q_stride_b", "q_stride_h",
         "kc_stride_block", "kc_stride_slot", "kc_stride_head", "vc_stride_block", "vc_stride_slot", "vc_stride_head",
         "bt_stride_b")


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"q_ptr": f"*{t}", "key_cache_ptr": f"*{t}", "value_cache_ptr": f"*{t}", "block_tables_ptr": "*i32",
            "seqlens_ptr": "*i32", "out_ptr": f"*{t}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "counter_ptr": "*i32", "scale_log2": "fp32", "softcap_scale": "fp32", "softcap_log2": "fp32",
            **dict.fromkeys(_INTS, "i32"),
            **dict.fromkeys(("HEAD_DIM", "HEAD_DIM_PAD", "GROUP_PAD", "BLOCK_SIZE", "TILE_N", "USE_SOFTCAP", "PDL"),
                            "constexpr")}


def _reduce_signature(dtype: torch.dtype) -> dict:
    return {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{TRITON_DTYPE[dtype]}",
            "num_splits": "i32", "numel": "i32", "HEAD_DIM": "constexpr"}


SPEC = register(KernelSpec("paged_decode", _paged_decode_kernel, _signature, AOT_DTYPES, CONFIGS))
SPEC_LARGE_HEAD = register(KernelSpec("paged_decode_d256", _paged_decode_kernel, _signature, AOT_DTYPES_D256,
                                      LARGE_HEAD_CONFIGS))
SPEC_REDUCE = register(KernelSpec("paged_decode_reduce", _paged_decode_reduce_kernel, _reduce_signature,
                                  AOT_DTYPES, REDUCE_CONFIGS))


# --- launcher -------------------------------------------------------------------------------------------

_DEVICE_STATE: dict = {}


def _device_state(device: torch.device) -> tuple[int, torch.Tensor]:
    """(CUs of ``device``, a 1-element fp32 tensor standing in for the workspace of the single pass, so every
    launch has the cross-compiled signature), cached: the launcher runs every decode step.  The interpreter counts
    4 CUs."""
    hit = _DEVICE_STATE.get(device)
    if hit is None:
        cus = 4
        if device.type == "cuda":
            from .. import backend

            index = device.index if device.index is not None else torch.cuda.current_device()
            cus = backend.describe_gpu(index).multiprocessor_count
        hit = _DEVICE_STATE[device] = (cus, torch.empty(1, dtype=torch.float32, device=device))
    return hit


def _config(head_dim: int, device: torch.device):
    head_dim_pad = max(16, 1 << (head_dim - 1).bit_length())
    return launch_config(CONFIGS if head_dim_pad <= 128 else LARGE_HEAD_CONFIGS, device)


def planned_splits(batch: int, num_kv_heads: int, block_size: int, head_dim: int, max_seqlen: int,
                   device: torch.device) -> int:
    """The split count the launcher plans for a call of this shape (``num_splits=None``)."""
    tile = _config(head_dim, device)[0].constexprs["TILE_N"]
    num_cus = _device_state(device)[0]
    return plan_splits(batch, num_kv_heads, max_seqlen, num_cus, math.lcm(tile, block_size)).num_splits


_WIDE: dict = {}


def uses_wide_combine(device: torch.device) -> bool:
    """Whether split launches on ``device`` are combined by ``paged_decode_combine`` (targets that have PDL,
    whether or not ``ANYGPU_PDL`` turns it off) rather than in the launch: one or the other on a target, never
    both, so a step's bits depend on neither the path nor the switch.  Cached: the launcher runs every step."""
    hit = _WIDE.get(device)
    if hit is None:
        hit = _WIDE[device] = target_supports_pdl(device_target(device))
    return hit


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seqlens: torch.Tensor, max_seqlen: int, scale: float | None = None, window_left: int = -1,
                 softcap: float = 0.0, num_splits: int | None = None,
                 wide_combine: bool | None = None) -> torch.Tensor:
    """Launch on q's device (a GPU, or the CPU under TRITON_INTERPRET=1).  Arguments as in the op;
    ``num_splits``: None plans with ``plan_splits``, k >= 1 launches exactly k splits (1: the single pass);
    ``wide_combine``: None takes the target's combine (``uses_wide_combine``), a bool forces one (tests)."""
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    out = q.new_empty(batch, q_heads, head_dim)
    if out.numel() == 0:
        return out
    if key_cache.numel() == 0:  # no cache: every sequence must be empty
        return out.zero_()
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = q_heads // kv_heads
    head_dim_pad = max(16, 1 << (head_dim - 1).bit_length())
    # seqlens is read at offset b and a block table row at offset j: both need unit stride.
    if seqlens.stride(0) != 1:
        seqlens = seqlens.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    cfg, options = _config(head_dim, q.device)
    tile = cfg.constexprs["TILE_N"]
    granule = math.lcm(tile, block_size)
    num_cus, no_workspace = _device_state(q.device)
    if num_splits is None:
        num_splits = plan_splits(batch, kv_heads, max_seqlen, num_cus, granule).num_splits
    scale = head_dim ** -0.5 if scale is None else scale
    if num_splits > 1:
        part_out = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:  # not written by the single pass
        part_out = part_lse = no_workspace
    kc, vc = key_cache, value_cache
    wide = uses_wide_combine(q.device) if wide_combine is None else wide_combine
    with on_device(q.device):  # counters() checks the current stream for a capture
        # One counter per (sequence, KV head) when splitting.  Asked for on an unsplit call too (one), so that a
        # warm-up step that does not split still makes the device's counters before a captured step that does.
        # The wide combine needs none.
        arrivals = None if wide else counters(q.device, batch * kv_heads if num_splits > 1 else 1)
        merge = num_splits > 1 and arrivals is not None
        _paged_decode_kernel[(batch, kv_heads, num_splits)](
            q, kc, vc, block_tables, seqlens, out, part_out, part_lse, arrivals if merge else unused_counters(q.device),
            scale * LOG2E, scale / softcap if softcap > 0 else 0.0, softcap * LOG2E, window_left, group, q_heads,
            granule, num_splits, int(merge), q.stride(0), q.stride(1), kc.stride(0), kc.stride(1),
            kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), block_tables.stride(0), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), BLOCK_SIZE=block_size,
            TILE_N=tile, USE_SOFTCAP=softcap > 0, **options, **pdl_args(q.device))
        if num_splits > 1 and wide:
            combine_splits(part_out, part_lse, out)
        elif num_splits > 1 and not merge:  # captured without counters: the partials are combined here
            _, roptions = launch_config(REDUCE_CONFIGS, q.device)
            _paged_decode_reduce_kernel[(triton.cdiv(out.numel(), MERGE_BLOCK.value),)](
                part_out, part_lse, out, num_splits, out.numel(), HEAD_DIM=head_dim, **roptions)
    return out
