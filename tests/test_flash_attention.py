"""Prefill attention: the FlashAttention kernel (packed varlen and paged K/V) against flash-attn's accuracy
rule, the ops (registration, references, argument checks, meta), and cross-compilation of the variants
the kernel registry does not compile.

Kernel tests run on the GPU, or on the CPU in Triton's interpreter (tiny shapes: it is slow); cases
that only a GPU runs in reasonable time are marked ``gpu``.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from anygpu.ops import flash_attn_varlen, paged_prefill
from anygpu.ops.flash_attn_varlen import check as varlen_check
from anygpu.ops.flash_attn_varlen import visible_keys
from anygpu.ops.paged_prefill import check as paged_check
from anygpu.kernels.launch import LaunchConfig
from anygpu.testing import assert_accurate, poison_

HEAD_DIMS = (64, 80, 96, 128, 256)
FP16_BF16 = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# Inputs and the two references of flash-attn's rule


def cumulative(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def make_varlen(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype, device):
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(k_lens), num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(sum(k_lens), num_kv_heads, head_dim, dtype=dtype, device=device)
    return q, k, v, cumulative(q_lens, device), cumulative(k_lens, device)


def attention_in(dtype, q, k, v, cu_q, cu_k, scale, causal, window_left=-1, softcap=0.0):
    """Per-sequence attention computed in ``dtype`` from explicit masks (flash-attn's ``attention_ref``),
    independent of the op's reference: in q's dtype it measures PyTorch's own error; in fp32 of the
    upcast inputs it is the oracle."""
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].to(dtype)
        ks = k[cu_k[b]:cu_k[b + 1]].to(dtype).repeat_interleave(group, 1)
        vs = v[cu_k[b]:cu_k[b + 1]].to(dtype).repeat_interleave(group, 1)
        q_len, k_len = qs.shape[0], ks.shape[0]
        if q_len == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        j = torch.arange(k_len, device=q.device)[None, :]
        seen = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
        if causal:
            seen &= j <= pos
        if window_left >= 0:
            seen &= j >= pos - window_left
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
        o = torch.einsum("hqk,khd->qhd", p, vs)
        o[~seen.any(1)] = 0  # a row that sees no key outputs 0
        out[cu_q[b]:cu_q[b + 1]] = o
    return out


def assert_rule(ours, q, k, v, cu_q, cu_k, scale, causal, window_left=-1, softcap=0.0, what=""):
    """flash-attn's rule: max error vs the fp32 oracle <= 2x PyTorch's same-dtype max error."""
    torch_same = attention_in(q.dtype, q, k, v, cu_q, cu_k, scale, causal, window_left, softcap)
    oracle = attention_in(torch.float64 if q.dtype == torch.float32 else torch.float32,
                          q, k, v, cu_q, cu_k, scale, causal, window_left, softcap)
    return assert_accurate(ours, torch_same, oracle, what=what)


def make_paged(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """A NaN-poisoned paged cache holding each sequence's full context in randomly scattered blocks.
    Block-table entries past a sequence's last block point at a spare block, also NaN: a read of
    anything the kernel should not see turns the output into NaN."""
    blocks_per_seq = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = poison_(torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device))
    v_cache = poison_(torch.empty_like(k_cache))
    order = torch.randperm(num_blocks - 1).tolist()  # the last block stays spare
    width = max(blocks_per_seq, default=0) + 2
    block_tables = torch.full((len(ctx_lens), width), num_blocks - 1, dtype=torch.int32)
    k, v = [], []
    for b, n in enumerate(ctx_lens):
        ks = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        vs = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        for i in range(blocks_per_seq[b]):
            block = order.pop()
            block_tables[b, i] = block
            rows = slice(i * block_size, min(n, (i + 1) * block_size))
            k_cache[block, : rows.stop - rows.start] = ks[rows]
            v_cache[block, : rows.stop - rows.start] = vs[rows]
        k.append(ks)
        v.append(vs)
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    return (q, k_cache, v_cache, block_tables.to(device), cumulative(q_lens, device),
            torch.tensor(ctx_lens, dtype=torch.int32, device=device), torch.cat(k), torch.cat(v),
            cumulative(ctx_lens, device))


# ---------------------------------------------------------------------------------------------------
# The kernel: packed variable-length sequences

# (q_lens, k_lens, Hq, Hkv, D, dtype, causal, window_left, softcap): every length class (1, odd, not a
# multiple of any tile, longer than a tile, empty), bottom-right causal with fewer queries than keys,
# more queries than keys (rows that see nothing), GQA and MQA, window and soft-cap, every head dim.
VARLEN_CASES = [
    ([1, 37, 130, 0, 64], [1, 37, 130, 0, 64], 2, 1, 64, torch.float16, True, -1, 0.0),
    ([17, 3, 90], [17, 3, 90], 2, 2, 80, torch.bfloat16, False, -1, 0.0),
    ([5, 70, 1], [40, 150, 9], 3, 1, 128, torch.bfloat16, True, -1, 0.0),
    ([20, 3], [5, 0], 2, 1, 64, torch.float16, True, -1, 0.0),
    ([150, 33], [150, 33], 2, 1, 64, torch.bfloat16, True, 16, 0.0),
    ([300], [300], 2, 1, 64, torch.float16, True, 150, 0.0),  # a window wider than two tiles: all 3 loops
    ([40, 9], [100, 9], 2, 2, 96, torch.float16, False, 7, 0.0),
    ([45, 8], [60, 8], 4, 2, 96, torch.float16, True, -1, 20.0),
    ([33], [33], 2, 1, 256, torch.bfloat16, True, 5, 10.0),
    ([24, 7], [24, 30], 2, 1, 128, torch.float32, True, -1, 0.0),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-"
                         f"{str(c[5]).removeprefix('torch.')}-{'causal' if c[6] else 'full'}-w{c[7]}-cap{c[8]}")
def test_varlen_kernel_within_rule(kdevice, case):
    from anygpu.kernels.flash_attention import flash_attn_varlen as kernel

    q_lens, k_lens, hq, hkv, d, dtype, causal, window, softcap = case
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, hq, hkv, d, dtype, kdevice)
    scale = d ** -0.5
    out = kernel(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale, causal, window, softcap)
    assert out.shape == q.shape and out.dtype == dtype and not out.isnan().any()
    assert_rule(out, q, k, v, cu_q, cu_k, scale, causal, window, softcap, what=str(case))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_varlen_kernel_every_head_dim(kdevice, head_dim):
    from anygpu.kernels.flash_attention import flash_attn_varlen as kernel

    q, k, v, cu_q, cu_k = make_varlen([19, 1], [19, 26], 2, 1, head_dim, torch.bfloat16, kdevice)
    out = kernel(q, k, v, cu_q, cu_k, 19, 26, 0.3, True)
    assert_rule(out, q, k, v, cu_q, cu_k, 0.3, True, what=f"d={head_dim}")


def test_varlen_kernel_rows_without_keys_and_empty_batches(kdevice):
    from anygpu.kernels.flash_attention import flash_attn_varlen as kernel

    # 3 queries over 0 keys; 4 queries over 2 keys, causal: the first two rows sit before every key.
    q, k, v, cu_q, cu_k = make_varlen([3, 4, 0], [0, 2, 5], 2, 2, 64, torch.float16, kdevice)
    out = kernel(q, k, v, cu_q, cu_k, 4, 5, 0.125, True)
    assert not out.isnan().any()
    assert out[:5].abs().max() == 0  # the 3 rows of sequence 0 and the first 2 of sequence 1
    assert out[5:].abs().min() > 0
    assert_rule(out, q, k, v, cu_q, cu_k, 0.125, True)
    # A window of 0 with causal masking: each row sees exactly its own key, so the output is that key's v
    # (to a rounding: the softmax weight of the one key is exp2(s - max) with s - max ~ 0 under FMA).
    q, k, v, cu_q, cu_k = make_varlen([6], [6], 2, 1, 64, torch.float16, kdevice)
    out = kernel(q, k, v, cu_q, cu_k, 6, 6, 0.125, True, 0)
    torch.testing.assert_close(out, v.expand(6, 2, 64), rtol=1e-3, atol=1e-3)
    # No sequences, and sequences with no queries at all.
    empty = torch.zeros(1, dtype=torch.int32, device=kdevice)
    none = torch.empty(0, 4, 64, dtype=torch.float16, device=kdevice)
    assert kernel(none, none[:, :2], none[:, :2], empty, empty, 0, 0, 0.1, True).shape == (0, 4, 64)
    q, k, v, cu_q, cu_k = make_varlen([0, 0], [3, 5], 4, 2, 64, torch.float16, kdevice)
    assert kernel(q, k, v, cu_q, cu_k, 0, 5, 0.1, False).shape == (0, 4, 64)


def test_varlen_kernel_strided_views(kdevice):
    """q, k, v as views into one fused QKV projection output (token stride != heads x head_dim)."""
    from anygpu.kernels.flash_attention import flash_attn_varlen as kernel

    hq, hkv, d = 4, 2, 64
    qkv = torch.randn(50, hq + 2 * hkv, d, dtype=torch.bfloat16, device=kdevice)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cu = cumulative([30, 20], kdevice)
    out = kernel(q, k, v, cu, cu, 30, 30, 0.125, True)
    assert out.is_contiguous()
    assert_rule(out, q, k, v, cu, cu, 0.125, True)


# ---------------------------------------------------------------------------------------------------
# The tensor-descriptor (TMA) variant of the packed kernel: q, k, v read as [tokens, heads x D] descriptors

# Small tiles for Triton's interpreter (the GPU runs the Hopper table's own configs).
TMA_TEST_CONFIG = LaunchConfig({"BLOCK_M": 16, "BLOCK_N": 16, "MAX_Q": None}, num_warps=4, num_stages=1)
# Query and key tiles that run past their sequence into the next one, and past the tensor's end (zeros).
TMA_CASES = [
    ([5, 40, 0, 19], [5, 40, 0, 19], 4, 2, 64, torch.bfloat16, True, -1, 0.0),
    ([7, 33], [20, 33], 2, 1, 64, torch.float16, False, 9, 10.0),
    ([30, 3], [30, 17], 2, 2, 64, torch.bfloat16, True, 4, 0.0),
    ([20, 9], [9, 21], 2, 1, 128, torch.bfloat16, True, -1, 0.0),
]


def _tma_configs(device):
    from anygpu.kernels.flash_attention import TMA_CONFIGS

    if torch.device(device).type == "cpu":
        return [TMA_TEST_CONFIG]
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("tensor-descriptor attention has configs for Hopper only")
    return list(TMA_CONFIGS["hopper"])


@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-d{c[4]}-{'causal' if c[6] else 'full'}"
                         f"-w{c[7]}-cap{c[8]}")
def test_varlen_tma_kernel_within_rule(kdevice, case):
    from anygpu.kernels.flash_attention import flash_attn_varlen as kernel

    q_lens, k_lens, hq, hkv, d, dtype, causal, window, softcap = case
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, hq, hkv, d, dtype, kdevice)
    for cfg in _tma_configs(kdevice):
        out = kernel(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), d ** -0.5, causal, window, softcap, tma=cfg)
        assert out.shape == q.shape and not out.isnan().any()
        assert_rule(out, q, k, v, cu_q, cu_k, d ** -0.5, causal, window, softcap, what=f"{case} {cfg.label()}")


def test_varlen_tma_kernel_keeps_other_sequences_out(kdevice):
    """A key tile that runs past its sequence reads the next one's K and V rows: NaN there (an overflowed
    request) must not reach this sequence's output, and the strided views of a fused QKV output work."""
    from anygpu.kernels.flash_attention import flash_attn_varlen as kernel

    hq, hkv, d = 4, 2, 64
    qkv = torch.randn(70, hq + 2 * hkv, d, dtype=torch.bfloat16, device=kdevice)
    qkv[45:] = float("nan")  # the third sequence
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cu = cumulative([25, 20, 25], kdevice)
    for cfg in _tma_configs(kdevice):
        out = kernel(q, k, v, cu, cu, 25, 25, 0.125, True, tma=cfg)
        assert not out[:45].isnan().any()
        assert_rule(out[:45], q[:45], k[:45], v[:45], cu[:3], cu[:3], 0.125, True, what=cfg.label())


def test_tma_only_on_hopper_and_only_for_descriptor_ready_tensors():
    from anygpu.backend.targets import parse_target_list
    from anygpu.kernels.flash_attention import TMA_CONFIGS, _descriptor_ready, tma_config
    from anygpu.kernels.launch import select

    for target in parse_target_list("ci"):
        assert bool(select(TMA_CONFIGS, target)) == (target.family == "hopper"), target.arch
    x = torch.randn(10, 4, 128, dtype=torch.bfloat16)
    assert _descriptor_ready(x) and _descriptor_ready(x[2:])
    assert not _descriptor_ready(torch.randn(5128, dtype=torch.bfloat16)[1:5121].view(10, 4, 128))  # base 2 B off
    assert not _descriptor_ready(torch.randn(10, 516, dtype=torch.bfloat16)[:, :512].view(10, 4, 128))  # row 1032 B
    assert not _descriptor_ready(x.transpose(0, 1).contiguous().transpose(0, 1))  # heads not contiguous
    assert not _descriptor_ready(x[:0])
    assert tma_config(x, x, x, 10) is None  # the CPU: the pointer kernel (the interpreter runs both)


# ---------------------------------------------------------------------------------------------------
# The kernel: prefill over a paged cache (chunked prefill, prefix caching)

# (ctx_lens, q_lens, Hq, Hkv, D, block_size, window_left, softcap): block sizes below the kernel's key
# tile (each key's block looked up) and above it (one block per tile), a whole prompt (q = ctx), a
# single new token, a chunk after a cached prefix.
PAGED_CASES = [
    ([45, 130, 17], [5, 70, 17], 4, 2, 64, 16, -1, 0.0),
    ([100, 1, 64], [1, 1, 30], 2, 1, 128, 128, -1, 0.0),
    ([90, 31], [40, 31], 2, 2, 80, 32, 20, 15.0),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: f"ctx{c[0]}-q{c[1]}-d{c[4]}-bs{c[5]}-w{c[6]}")
@pytest.mark.parametrize("dtype", FP16_BF16)
def test_paged_prefill_kernel_equals_dense_attention_over_the_sequence(kdevice, case, dtype):
    from anygpu.kernels.flash_attention import flash_attn_varlen as dense
    from anygpu.kernels.flash_attention import paged_prefill as kernel

    ctx, q_lens, hq, hkv, d, block_size, window, softcap = case
    q, k_cache, v_cache, tables, cu_q, seqlens, k, v, cu_k = make_paged(ctx, q_lens, hq, hkv, d, block_size, dtype,
                                                                         kdevice)
    scale = d ** -0.5
    out = kernel(q, k_cache, v_cache, tables, cu_q, seqlens, max(q_lens), max(ctx), scale, window, softcap)
    assert not out.isnan().any()  # no NaN slot or spare block was read
    # The new tokens are the last positions of their sequence: dense causal attention over it.
    expected = dense(q, k, v, cu_q, cu_k, max(q_lens), max(ctx), scale, True, window, softcap)
    torch.testing.assert_close(out, expected, rtol=0, atol=2 * torch.finfo(dtype).eps)
    assert_rule(out, q, k, v, cu_q, cu_k, scale, True, window, softcap, what=str(case))


# ---------------------------------------------------------------------------------------------------
# Larger cases where a GPU runs them (flash-attn's test lengths)

GPU_LENGTHS = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (2048, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", FP16_BF16)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kernel_flash_attn_lengths_on_gpu(head_dim, dtype, causal):
    from anygpu.kernels.flash_attention import flash_attn_varlen as kernel

    q_lens = [sq for sq, _ in GPU_LENGTHS]
    k_lens = [sk for _, sk in GPU_LENGTHS]
    for hq, hkv in ((6, 6), (6, 2), (6, 1)):
        q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, hq, hkv, head_dim, dtype, "cuda")
        out = kernel(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), head_dim ** -0.5, causal)
        assert_rule(out, q, k, v, cu_q, cu_k, head_dim ** -0.5, causal, what=f"{hq}/{hkv} heads")
        for window, softcap in ((256, 0.0), (-1, 30.0)):
            out = kernel(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), head_dim ** -0.5, causal, window, softcap)
            assert_rule(out, q, k, v, cu_q, cu_k, head_dim ** -0.5, causal, window, softcap,
                        what=f"{hq}/{hkv} heads window {window} softcap {softcap}")


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_paged_prefill_kernel_long_prefixes_on_gpu(block_size, head_dim):
    from anygpu.kernels.flash_attention import flash_attn_varlen as dense
    from anygpu.kernels.flash_attention import paged_prefill as kernel

    ctx, q_lens = [1328, 18, 463, 2000], [1, 18, 129, 512]
    q, k_cache, v_cache, tables, cu_q, seqlens, k, v, cu_k = make_paged(ctx, q_lens, 8, 2, head_dim, block_size,
                                                                         torch.bfloat16, "cuda")
    out = kernel(q, k_cache, v_cache, tables, cu_q, seqlens, max(q_lens), max(ctx), head_dim ** -0.5)
    assert not out.isnan().any()
    expected = dense(q, k, v, cu_q, cu_k, max(q_lens), max(ctx), head_dim ** -0.5, True)
    torch.testing.assert_close(out, expected, rtol=0, atol=2 * torch.finfo(torch.bfloat16).eps)
    assert_rule(out, q, k, v, cu_q, cu_k, head_dim ** -0.5, True)


# ---------------------------------------------------------------------------------------------------
# The ops


def test_bottom_right_causal_semantics():
    # 2 queries over 4 keys: they are keys 2 and 3's positions.
    assert visible_keys(2, 4, True, -1, "cpu").tolist() == [[True, True, True, False], [True, True, True, True]]
    # 3 queries over 2 keys: the first query sits before every key.
    assert visible_keys(3, 2, True, -1, "cpu").tolist() == [[False, False], [True, False], [True, True]]
    # A window of 1 with causal: the key at the row's position and the one before.
    assert visible_keys(3, 3, True, 1, "cpu").tolist() == [[True, False, False], [True, True, False],
                                                           [False, True, True]]
    # A window without causal masking bounds the left side only.
    assert visible_keys(2, 3, False, 0, "cpu").tolist() == [[False, True, True], [False, False, True]]


def _varlen_args(device="cpu", dtype=torch.float32, window=-1, softcap=0.0, q_lens=(5, 1, 12), k_lens=(9, 4, 12),
                 hq=4, hkv=2, d=64):
    q, k, v, cu_q, cu_k = make_varlen(list(q_lens), list(k_lens), hq, hkv, d, dtype, device)
    return (q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), d ** -0.5, True, window, softcap)


def _paged_args(device="cpu", dtype=torch.float32, window=-1, softcap=0.0):
    q, k_cache, v_cache, tables, cu_q, seqlens, *_ = make_paged([30, 5], [7, 5], 4, 2, 64, 16, dtype, device)
    return (q, k_cache, v_cache, tables, cu_q, seqlens, 7, 30, 0.125, window, softcap)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", FP16_BF16)
def test_opcheck(device, dtype):
    torch.library.opcheck(flash_attn_varlen.overload, _varlen_args(device, dtype, window=3, softcap=5.0))
    torch.library.opcheck(flash_attn_varlen.overload, _varlen_args(device, dtype)[:9])  # the defaults
    torch.library.opcheck(paged_prefill.overload, _paged_args(device, dtype, window=4))


@pytest.mark.parametrize("dtype", (*FP16_BF16, torch.float32))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_varlen_reference_within_rule(dtype, head_dim):
    for causal in (True, False):
        for window, softcap in ((-1, 0.0), (9, 0.0), (-1, 30.0)):
            args = list(_varlen_args(dtype=dtype, window=window, softcap=softcap, d=head_dim, hq=6, hkv=2,
                                     q_lens=(7, 1, 0, 40), k_lens=(30, 6, 3, 40)))
            args[8] = causal
            q, k, v, cu_q, cu_k, _, _, scale = args[:8]
            assert_rule(flash_attn_varlen(*args), q, k, v, cu_q, cu_k, scale, causal, window, softcap,
                        what=f"d={head_dim} causal={causal} window={window} softcap={softcap}")


@pytest.mark.parametrize("dtype", FP16_BF16)
def test_paged_reference_within_rule_and_ignores_unused_slots(dtype):
    for window, softcap in ((-1, 0.0), (10, 20.0)):
        q, k_cache, v_cache, tables, cu_q, seqlens, k, v, cu_k = make_paged([45, 16, 3], [13, 16, 1], 4, 1, 96, 16,
                                                                             dtype, "cpu")
        out = paged_prefill(q, k_cache, v_cache, tables, cu_q, seqlens, 16, 45, 0.1, window, softcap)
        assert not out.isnan().any()
        assert_rule(out, q, k, v, cu_q, cu_k, 0.1, True, window, softcap)
        torch.testing.assert_close(out, flash_attn_varlen(q, k, v, cu_q, cu_k, 16, 45, 0.1, True, window, softcap),
                                   rtol=0, atol=0)


def test_reference_of_long_soft_capped_rows_is_chunked():
    # More query rows than the reference materialises scores for at once.
    from anygpu.ops.flash_attn_varlen import QUERY_CHUNK

    args = _varlen_args(q_lens=(QUERY_CHUNK + 70,), k_lens=(QUERY_CHUNK + 70,), hq=1, hkv=1, d=16, softcap=10.0)
    assert_rule(flash_attn_varlen(*args), *args[:5], args[7], True, -1, 10.0)


def test_meta_shapes_and_checks_read_no_values():
    """The checks never read a device tensor's values: on meta tensors any read would raise."""
    meta = _varlen_args(device="meta", dtype=torch.bfloat16)
    varlen_check(*meta)
    out = flash_attn_varlen(*meta)
    assert out.shape == meta[0].shape and out.dtype == torch.bfloat16 and out.device.type == "meta"
    q, k_cache, v_cache, tables, cu_q, seqlens, *rest = _paged_args(dtype=torch.bfloat16)
    meta = tuple(t.to("meta") for t in (q, k_cache, v_cache, tables, cu_q, seqlens)) + tuple(rest)
    paged_check(*meta)
    assert paged_prefill(*meta).shape == q.shape


def test_compile():
    args = _varlen_args()
    compiled = torch.compile(lambda *a: flash_attn_varlen(*a) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*args), flash_attn_varlen(*args) * 2)


def _bad(args, index, value):
    """``args`` with ``value`` at ``index`` (at each of them, for a tuple of indices)."""
    args = list(args)
    for i in index if isinstance(index, tuple) else (index,):
        args[i] = value
    return args


def test_varlen_bad_arguments_name_the_argument():
    good = _varlen_args(dtype=torch.float16)
    q, k, v, cu_q, cu_k = good[:5]
    cases = [
        (0, q[0], r"q: expected a 3-D tensor \[total_q, num_heads, head_dim\], got \(4, 64\)"),
        (0, q.int(), "q: expected dtype float16, bfloat16 or float32, got torch.int32"),
        (0, torch.zeros(18, 4, 320, dtype=torch.float16), "q: expected a head dim between 1 and 256, got 320"),
        (1, k.float(), "k: expected q's dtype torch.float16, got torch.float32"),
        (2, v[:, :, :32], "v: expected q's head dim 64, got 32"),
        (2, v[:-1], r"v: expected the shape of k \(25, 2, 64\), got \(24, 2, 64\)"),
        ((1, 2), torch.zeros(25, 3, 64, dtype=torch.float16),
         "k: expected a number of K/V heads dividing q's 4 heads, got 3"),
        (1, k.to("meta"), "k: expected a tensor on q's device cpu, got meta"),
        (3, cu_q.long(), "cu_seqlens_q: expected a 1-D int32 tensor, got torch.int64"),
        (3, cu_q[:0], r"cu_seqlens_q: expected B\+1 >= 1 entries"),
        (4, cu_k[:-1], "cu_seqlens_k: expected 4 entries, got 3"),
        (4, cu_k.to("meta"), "cu_seqlens_k: expected a tensor on q's device cpu, got meta"),
        (5, -1, "max_seqlen_q: expected a non-negative int, got -1"),
        (6, 2.5, "max_seqlen_k: expected a non-negative int, got 2.5"),
        (7, 0.0, "softmax_scale: expected a positive finite float, got 0.0"),
        (7, math.inf, "softmax_scale: expected a positive finite float, got inf"),
        (8, 1, "causal: expected a bool, got 1"),
        (9, -2, "window_left: expected an int >= 0, or -1 for no window, got -2"),
        (10, -1.0, r"softcap: expected a finite float >= 0 \(0: no soft-capping\), got -1.0"),
    ]
    for index, value, message in cases:
        # Through the check: torch's dispatcher rejects some wrongly typed scalars itself (RuntimeError).
        with pytest.raises(ValueError, match=message):
            varlen_check(*_bad(good, index, value))
        if not isinstance(value, (int, float)):
            with pytest.raises(ValueError, match=message):
                flash_attn_varlen(*_bad(good, index, value))


def test_paged_bad_arguments_name_the_argument():
    good = _paged_args(dtype=torch.bfloat16)
    q, k_cache, v_cache, tables, cu_q, seqlens = good[:6]
    cases = [
        (1, k_cache[0], "k_cache: expected a 4-D tensor, got"),
        ((1, 2), torch.zeros(4, 24, 2, 64, dtype=torch.bfloat16), "k_cache: expected .* power-of-two block_size"),
        (2, v_cache.half(), "v_cache: expected q's dtype torch.bfloat16, got torch.float16"),
        (1, k_cache.transpose(2, 3).contiguous().transpose(2, 3),
         r"k_cache: expected a contiguous last dimension \(stride 1\)"),
        (3, tables.long(), r"block_tables: expected an int32 tensor \[2, max_blocks_per_seq\]"),
        (3, tables[:1], r"block_tables: expected an int32 tensor \[2, max_blocks_per_seq\] .* got torch.int32 of "
                        r"shape \(1, 4\)"),
        (3, tables.to("meta"), "block_tables: expected a tensor on q's device cpu, got meta"),
        (5, seqlens[:1], "seqlens_k: expected 2 entries, got 1"),
        (5, seqlens.float(), "seqlens_k: expected a 1-D int32 tensor, got torch.float32"),
        (8, -0.5, "softmax_scale: expected a positive finite float"),
        (9, -3, "window_left: expected an int >= 0"),
    ]
    for index, value, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_check(*_bad(good, index, value))
        with pytest.raises(ValueError, match=message):
            paged_prefill(*_bad(good, index, value))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP16_BF16)
def test_gpu_dispatch_runs_the_triton_kernel(dtype, monkeypatch):
    from anygpu.kernels.flash_attention import flash_attn_varlen as dense
    from anygpu.kernels.flash_attention import paged_prefill as paged

    args = _varlen_args("cuda", dtype, window=11, softcap=25.0)
    torch.testing.assert_close(flash_attn_varlen(*args), dense(*args), rtol=0, atol=0)
    pargs = _paged_args("cuda", dtype)
    torch.testing.assert_close(paged_prefill(*pargs), paged(*pargs), rtol=0, atol=0)
    monkeypatch.setenv("ANYGPU_KERNELS", "reference")
    assert_rule(flash_attn_varlen(*args), *args[:5], args[7], True, 11, 25.0)


# ---------------------------------------------------------------------------------------------------
# Cross-compilation of what the registry does not compile (it compiles packed K/V, causal, D = 128)


@pytest.mark.aot
def test_tma_variant_with_window_and_softcap_compiles_for_hopper():
    from anygpu.backend.targets import lookup
    from anygpu.kernels.aot import compile_one
    from anygpu.kernels.flash_attention import TMA_SPEC, AttentionSpec, aot_table

    target = lookup("sm_90")
    table = aot_table(128, causal=False, window=True, softcap=True, desc=True)
    spec = AttentionSpec(TMA_SPEC.name, TMA_SPEC.fn, TMA_SPEC.signature, TMA_SPEC.dtypes, table)
    for config in table["hopper"]:
        report = compile_one(spec, target, config, torch.bfloat16)
        assert report.ok and report.shared <= target.shared_per_block, report


def _compile(target, head_dim, **variant):
    from anygpu.backend.targets import lookup
    from anygpu.kernels.aot import compile_one
    from anygpu.kernels.launch import select
    from anygpu.kernels.flash_attention import SPEC, AttentionSpec, aot_table

    spec = AttentionSpec(SPEC.name, SPEC.fn, SPEC.signature, SPEC.dtypes, aot_table(head_dim, **variant))
    target = lookup(target)
    (config,) = select(spec.configs, target)
    report = compile_one(spec, target, config, torch.bfloat16)
    assert report.ok, report
    assert report.shared <= target.shared_per_block, report
    if report.spills:
        warnings.warn(f"spills: {report.kernel} d={head_dim} {variant} on {report.target} [{report.config}]: "
                      f"{report.spills}", stacklevel=2)
    return report


# Four compiles (the registry's two dozen already take most of the cross-compile budget).
@pytest.mark.aot
def test_head_dim_256_fits_rdna3s_64_kib_lds():
    """Head dim 256 with every feature on, on gfx1100 (64 KiB of LDS per workgroup, wave32)."""
    report = _compile("gfx1100", 256, causal=True, window=True, softcap=True)
    assert report.shared <= 64 * 1024


@pytest.mark.aot
def test_paged_head_dim_256_fits_cdna3s_64_kib_lds():
    """The paged variant at head dim 256, all features, on gfx942; block size 32 >= its 32-key tile, so
    one block-table lookup per tile."""
    report = _compile("gfx942", 256, causal=True, window=True, softcap=True, page_size=32)
    assert report.shared <= 64 * 1024


@pytest.mark.aot
def test_paged_variant_with_small_blocks_compiles_for_hopper():
    """Block size 16 below sm_90's 128-key tile: a block-table lookup per key."""
    _compile("sm_90", 128, page_size=16)


@pytest.mark.aot
def test_head_dim_256_fits_the_99_kib_nvidia_parts():
    """sm_86 / sm_89 (99 KiB per block) have configs of their own, which CI's targets do not compile."""
    _compile("sm_86", 256)


# ---------------------------------------------------------------------------------------------------
# The bench suite's cases (run once, never timed: tests do not time anything)


def test_bench_cases_and_their_baselines_compute_the_same_attention():
    from anygpu.bench.suites.attention import attention

    cases = attention(torch.device("cpu"), True)
    prefill = [c for c in cases if c.op == "flash_attn_varlen"]
    assert len(prefill) == 4 and {"causal" in c.shape for c in prefill} == {True, False}
    (paged,) = [c for c in cases if c.op == "paged_prefill"]
    for case in (*prefill, paged):
        ours = case.ours()
        assert case.flops and case.baselines
        for name, baseline in case.baselines.items():
            theirs = baseline()
            if theirs.dim() == 4:  # SDPA's [B, H, S, D]
                theirs = theirs.transpose(1, 2).reshape(ours.shape)
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=f"{case.shape} vs {name}")
