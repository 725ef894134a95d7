"""Paged KV cache write (reshape_and_cache) and paged decode attention: kernels against their references
(on the GPU, or the CPU in Triton's interpreter), the ops (opcheck, meta, argument errors), the split plan.

Unused cache slots and unused blocks hold NaN and unused block-table entries a block id far out of range,
so a kernel that reads one fails.  Shapes are tiny in the interpreter and larger on a GPU.
"""

import math

import pytest
import torch

from anygpu.ops import paged_decode, reshape_and_cache
from anygpu.ops.paged_decode import gather_attention
from anygpu.ops.paged_decode import reference as decode_reference
from anygpu.ops.reshape_and_cache import reference as cache_reference
from anygpu.testing import assert_accurate, reference_dtype

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GARBAGE_BLOCK = 1 << 30  # in unused block-table entries: dereferencing one would fault or read garbage


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so NaN payloads and -0.0 compare exactly."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --- reshape_and_cache -----------------------------------------------------------------------------------


def fused_kv(tokens, heads, head_dim, dtype, device):
    """key and value as views of a fused [tokens, (q + k + v) heads * D] projection: token stride != Hkv*D."""
    qkv = torch.randn(tokens, 4 * heads * head_dim, device=device).to(dtype)
    key = qkv[:, 2 * heads * head_dim:3 * heads * head_dim].view(tokens, heads, head_dim)
    value = qkv[:, 3 * heads * head_dim:].view(tokens, heads, head_dim)
    key[0, 0, 0], key[-1, -1, -1] = -0.0, float("inf")  # bit patterns a conversion could change
    return key, value


def cache_case(tokens, heads, head_dim, block_size, num_blocks, dtype, device, padded=(1, 4)):
    key, value = fused_kv(tokens, heads, head_dim, dtype, device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[[p for p in padded if p < tokens]] = -1
    kv = torch.full((2, num_blocks, block_size, heads, head_dim), float("nan"), dtype=dtype, device=device)
    return key, value, kv[0], kv[1], slots  # the caches: views of one stacked tensor, as engines allocate them


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (80, 8), (128, 32)])
def test_reshape_and_cache_kernel_is_bit_exact_and_skips_padding(kdevice, dtype, head_dim, block_size):
    from anygpu.kernels.kv_cache import reshape_and_cache as kernel

    big = kdevice.type == "cuda"
    tokens, heads, num_blocks = (300, 8, 64) if big else (9, 3, 4)
    key, value, key_cache, value_cache, slots = cache_case(tokens, heads, head_dim, block_size, num_blocks, dtype,
                                                           kdevice)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    cache_reference(key, value, want_k, want_v, slots)
    kernel(key, value, key_cache, value_cache, slots)
    assert torch.equal(bits(key_cache), bits(want_k)) and torch.equal(bits(value_cache), bits(want_v))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=kdevice)
    written[slots[slots >= 0]] = True
    untouched = key_cache.reshape(-1, heads, head_dim)[~written]
    assert untouched.isnan().all(), "a padded (-1) slot or an unnamed slot was written"
    assert not key_cache.reshape(-1, heads, head_dim)[written].isnan().any()


def test_reshape_and_cache_kernel_all_padding_and_empty(kdevice):
    from anygpu.kernels.kv_cache import reshape_and_cache as kernel

    key, value, key_cache, value_cache, _ = cache_case(5, 2, 64, 16, 2, torch.float16, kdevice)
    kernel(key, value, key_cache, value_cache, torch.full((5,), -1, dtype=torch.int64, device=kdevice))
    assert key_cache.isnan().all() and value_cache.isnan().all()
    kernel(key[:0], value[:0], key_cache, value_cache, torch.empty(0, dtype=torch.int64, device=kdevice))
    assert key_cache.isnan().all()


def masked_write(key, value, key_cache, value_cache, slots):
    """The plain statement of the op (a boolean mask: it reads the mask on the host), the reference's oracle."""
    valid = slots >= 0
    block, offset = slots[valid] // key_cache.shape[1], slots[valid] % key_cache.shape[1]
    key_cache[block, offset], value_cache[block, offset] = key[valid], value[valid]


@pytest.mark.parametrize("padded", [(), (1, 4), (0, 1), (0, 1, 2, 3, 4, 5, 6, 7, 8)])
@pytest.mark.parametrize("form", ["reference", "cpu", "cpu, strided cache"])
def test_reshape_and_cache_reference_matches_the_masked_write(padded, form):
    """Padding first, in the middle, everywhere: the reference (sync-free: capturable on a GPU) and the CPU
    implementation (fewer ops, the padding read on the host; a flat view of the cache's slots, or, where the
    cache's strides do not allow one, two-dimensional indexing) write exactly what the mask says."""
    from anygpu.ops.reshape_and_cache import cpu_write

    key, value, key_cache, value_cache, slots = cache_case(9, 3, 64, 8, 4, torch.bfloat16, "cpu", padded)
    if form == "cpu, strided cache":  # blocks and rows swapped in memory: no view merges them
        key_cache, value_cache = (c.transpose(0, 1).contiguous().transpose(0, 1) for c in (key_cache, value_cache))
        with pytest.raises(RuntimeError):
            key_cache.view(-1, *key_cache.shape[2:])
    want_k, want_v = key_cache.clone(), value_cache.clone()
    masked_write(key, value, want_k, want_v, slots)
    (cache_reference if form == "reference" else cpu_write)(key, value, key_cache, value_cache, slots)
    assert torch.equal(bits(key_cache), bits(want_k)) and torch.equal(bits(value_cache), bits(want_v))


def test_reshape_and_cache_reference_never_reads_device_values():
    """Under fake tensors a data-dependent step (a mask index, ``.item()``) raises: the reference has none, so a
    decode step on the references can be captured in a CUDA/HIP graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = cache_case(9, 3, 64, 8, 4, torch.float16, "cpu")
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(t) for t in case]
        cache_reference(*fake)
        with pytest.raises(Exception):
            masked_write(*fake)  # the check can fail: the masked form is caught


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_opcheck(device, dtype):
    args = cache_case(6, 2, 32, 8, 3, dtype, torch.device(device))
    torch.library.opcheck(reshape_and_cache.overload, args)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_reshape_and_cache_op_writes_in_place_and_compiles(device):
    key, value, key_cache, value_cache, slots = cache_case(7, 2, 64, 16, 2, torch.bfloat16, torch.device(device))
    want_k, want_v = key_cache.clone(), value_cache.clone()
    cache_reference(key, value, want_k, want_v, slots)
    assert reshape_and_cache(key, value, key_cache, value_cache, slots) is None
    assert torch.equal(bits(key_cache), bits(want_k)) and torch.equal(bits(value_cache), bits(want_v))
    key_cache.fill_(float("nan"))
    value_cache.fill_(float("nan"))
    compiled = torch.compile(lambda *a: reshape_and_cache(*a), fullgraph=True, backend="aot_eager")
    compiled(key, value, key_cache, value_cache, slots)  # functionalized, then copied back into the caches
    assert torch.equal(bits(key_cache), bits(want_k)) and torch.equal(bits(value_cache), bits(want_v))


def test_reshape_and_cache_meta():
    args = [t.to("meta") for t in cache_case(4, 2, 64, 16, 2, torch.float16, torch.device("cpu"))]
    assert reshape_and_cache(*args) is None


def test_reshape_and_cache_bad_arguments_name_the_argument():
    key, value, kc, vc, slots = cache_case(4, 2, 64, 16, 2, torch.float16, torch.device("cpu"))
    cases = [
        ((key[0], value, kc, vc, slots), r"key: expected shape \[tokens, num_kv_heads, head_dim\]"),
        ((key.int(), value, kc, vc, slots), "key: expected dtype float16, bfloat16 or float32, got torch.int32"),
        ((key, value.float(), kc, vc, slots), "value: expected torch.float16 of key's shape"),
        ((key, value, kc[..., :32], vc, slots), r"key_cache: expected shape \[num_blocks, block_size, 2, 64\]"),
        ((key, value, kc, vc.float(), slots), "value_cache: expected key's dtype torch.float16"),
        ((key, value, kc, vc[:1], slots), "value_cache: expected key_cache's shape"),
        ((key, value, kc.transpose(2, 3).contiguous().transpose(2, 3), vc, slots), "key_cache: expected unit stride"),
        ((key, value, kc, vc, slots.int()), r"slot_mapping: expected int64 of shape \[4\]"),
        ((key, value, kc, vc, slots[:3]), r"slot_mapping: expected int64 of shape \[4\]"),
        ((key, value, kc, vc, slots.to("meta")), "slot_mapping: expected key, value, key_cache, value_cache and"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            reshape_and_cache(*args)


# --- paged decode: the reference -------------------------------------------------------------------------


def paged_case(seqlens, q_heads, kv_heads, head_dim, block_size, dtype, device, spare_blocks=3, in_order=False):
    """q, NaN-poisoned caches with the live tokens written through random, non-contiguous block tables, tables,
    seqlens and max_seqlen.  Unused table entries hold GARBAGE_BLOCK.  ``in_order``: each sequence's blocks are
    consecutive instead (as a fresh engine's pool hands them out), after ``spare_blocks`` unused ones."""
    batch = len(seqlens)
    max_blocks = max(1, -(-max(seqlens) // block_size)) + 1  # one more column than needed: never read
    used = [-(-n // block_size) for n in seqlens]
    num_blocks = sum(used) + spare_blocks
    # popped from the end; in order: blocks spare_blocks, spare_blocks + 1, ... (the spare ones first, so
    # sequences start past block 0)
    perm = list(range(num_blocks - 1, spare_blocks - 1, -1)) if in_order else torch.randperm(num_blocks).tolist()
    tables = torch.full((batch, max_blocks), GARBAGE_BLOCK, dtype=torch.int32)
    key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    for b, n in enumerate(seqlens):
        tables[b, :used[b]] = torch.tensor([perm.pop() for _ in range(used[b])], dtype=torch.int32)
        pos = torch.arange(n)
        blocks, rows = tables[b, pos // block_size].long(), pos % block_size
        key_cache[blocks, rows] = torch.randn(n, kv_heads, head_dim).to(dtype)
        value_cache[blocks, rows] = torch.randn(n, kv_heads, head_dim).to(dtype)
    q = torch.randn(batch, q_heads, head_dim).to(dtype)
    return (q.to(device), key_cache.to(device), value_cache.to(device), tables.to(device),
            torch.tensor(seqlens, dtype=torch.int32, device=device), max(seqlens))


def naive_decode(q, key_cache, value_cache, tables, seqlens, scale, window_left, softcap):
    """Sequence by sequence, token by token, in fp64: an independent check of the reference."""
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seqlens[b])
        first = 0 if window_left < 0 else max(0, n - 1 - window_left)
        pos = list(range(first, n))
        if not pos:
            continue
        blocks = [int(tables[b, p // block_size]) for p in pos]
        k = torch.stack([key_cache[blk, p % block_size] for blk, p in zip(blocks, pos)]).double()
        v = torch.stack([value_cache[blk, p % block_size] for blk, p in zip(blocks, pos)]).double()
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            s = k[:, kv] @ q[b, h].double() * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            out[b, h] = torch.softmax(s, 0) @ v[:, kv]
    return out


@pytest.mark.parametrize("window_left,softcap", [(-1, 0.0), (5, 0.0), (-1, 3.0), (0, 0.0)])
def test_reference_matches_a_naive_loop(window_left, softcap):
    q, kc, vc, tables, seqlens, max_seqlen = paged_case([19, 1, 0, 33], 6, 2, 16, 8, torch.float32, "cpu")
    ours = gather_attention(q, kc, vc, tables, seqlens, 0.3, window_left, softcap, torch.float64)
    torch.testing.assert_close(ours, naive_decode(q, kc, vc, tables, seqlens, 0.3, window_left, softcap))
    assert not decode_reference(q, kc, vc, tables, seqlens, max_seqlen, 0.3, window_left, softcap).isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unused_slots_holding_nan_never_reach_the_answer(dtype):
    """The caches' unused slots are NaN-poisoned; the reference (and the same-dtype answer the tests compare
    with) must not see them, whatever the matmul does with a NaN row (PyTorch's bf16 batched matmul on AVX-512
    CPUs spreads it to the other rows' scores)."""
    q, kc, vc, tables, seqlens, max_seqlen = paged_case([5, 0, 150, 70], 16, 2, 80, 16, dtype, "cpu")
    for window_left in (-1, 20):
        out = gather_attention(q, kc, vc, tables, seqlens, None, window_left, 2.5, dtype)
        assert not out.isnan().any(), (dtype, window_left)


# --- paged decode: the kernel ----------------------------------------------------------------------------


def check_decode(out, q, kc, vc, tables, seqlens, scale=None, window_left=-1, softcap=0.0, what=""):
    assert out.shape == q.shape and out.dtype == q.dtype and not out.isnan().any(), what
    oracle = gather_attention(q, kc, vc, tables, seqlens, scale, window_left, softcap, reference_dtype(q.dtype))
    same_dtype = gather_attention(q, kc, vc, tables, seqlens, scale, window_left, softcap, q.dtype)
    assert_accurate(out, same_dtype, oracle, what=what)
    assert (out[seqlens == 0] == 0).all(), f"{what}: a sequence of length 0 must give 0"


def decode_shape(kdevice):
    """(seqlens, q_heads, kv_heads): tiny in the interpreter; on a GPU, long enough for many tiles and splits."""
    if kdevice.type == "cuda":
        return [1, 0, 1000, 4099, 17, 2048], 32, 8
    return [1, 0, 37, 70], 8, 2


@pytest.mark.parametrize("dtype,head_dim", [(torch.float16, 128), (torch.bfloat16, 128), (torch.float32, 128),
                                            (torch.bfloat16, 64), (torch.float16, 80), (torch.bfloat16, 96),
                                            (torch.bfloat16, 256)])
def test_paged_decode_kernel_accuracy(kdevice, dtype, head_dim):
    from anygpu.kernels.paged_decode import paged_decode as kernel

    seqlens, q_heads, kv_heads = decode_shape(kdevice)
    q, kc, vc, tables, lens, max_seqlen = paged_case(seqlens, q_heads, kv_heads, head_dim, 16, dtype, kdevice)
    check_decode(kernel(q, kc, vc, tables, lens, max_seqlen), q, kc, vc, tables, lens, what=f"{dtype} d{head_dim}")


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 1), (4, 4), (6, 3), (32, 1)])  # MQA, MHA, GQA 2:1, MQA 32:1
@pytest.mark.parametrize("block_size", [8, 32])
def test_paged_decode_kernel_head_groups_and_block_sizes(kdevice, q_heads, kv_heads, block_size):
    from anygpu.kernels.paged_decode import paged_decode as kernel

    seqlens = [70, 1, 0, 33] if kdevice.type != "cuda" else [3000, 1, 0, 333]
    q, kc, vc, tables, lens, max_seqlen = paged_case(seqlens, q_heads, kv_heads, 64, block_size, torch.bfloat16,
                                                     kdevice)
    check_decode(kernel(q, kc, vc, tables, lens, max_seqlen, 0.2), q, kc, vc, tables, lens, 0.2,
                 what=f"{q_heads}/{kv_heads} heads, block {block_size}")


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("window_left,softcap", [(-1, 0.0), (20, 0.0), (-1, 2.5), (0, 0.0), (9, 8.0)])
def test_paged_decode_kernel_window_softcap_and_splits(kdevice, num_splits, window_left, softcap):
    from anygpu.kernels.paged_decode import paged_decode as kernel

    seqlens, q_heads, kv_heads = decode_shape(kdevice)
    q, kc, vc, tables, lens, max_seqlen = paged_case(seqlens, q_heads, kv_heads, 64, 16, torch.float16, kdevice)
    out = kernel(q, kc, vc, tables, lens, max_seqlen, None, window_left, softcap, num_splits=num_splits)
    check_decode(out, q, kc, vc, tables, lens, None, window_left, softcap,
                 what=f"window {window_left} softcap {softcap} splits {num_splits}")


def test_paged_decode_kernel_split_path_equals_single_pass(kdevice):
    from anygpu.kernels.paged_decode import CONFIGS, fixed_splits, paged_decode as kernel
    from anygpu.kernels.launch import device_target, select

    seqlens, q_heads, kv_heads = decode_shape(kdevice)
    q, kc, vc, tables, lens, max_seqlen = paged_case(seqlens, q_heads, kv_heads, 64, 16, torch.float32, kdevice)
    tile = select(CONFIGS, device_target(kdevice))[0].constexprs["TILE_N"]
    assert fixed_splits(max_seqlen, 4, math.lcm(tile, 16)).num_splits > 1  # the split path really runs
    single = kernel(q, kc, vc, tables, lens, max_seqlen, num_splits=1)
    split = kernel(q, kc, vc, tables, lens, max_seqlen, num_splits=4)
    torch.testing.assert_close(split, single, rtol=1e-5, atol=1e-5)
    check_decode(split, q, kc, vc, tables, lens, what="split fp32")
    # max_seqlen only sizes the work: too low a bound is slower, never wrong (the last split runs to the end).
    torch.testing.assert_close(kernel(q, kc, vc, tables, lens, max_seqlen // 2, num_splits=4), single,
                               rtol=1e-5, atol=1e-5)
    # A decode graph's bound: max_seqlen far above every sequence, many splits; each sequence cuts its own keys
    # (with a sliding window: only the window's), so short ones use several splits and none is lost.
    torch.testing.assert_close(kernel(q, kc, vc, tables, lens, 16 * max_seqlen, num_splits=16), single,
                               rtol=1e-5, atol=1e-5)
    windowed = kernel(q, kc, vc, tables, lens, 16 * max_seqlen, None, 37, num_splits=16)
    torch.testing.assert_close(windowed, kernel(q, kc, vc, tables, lens, max_seqlen, None, 37, num_splits=1),
                               rtol=1e-5, atol=1e-5)
    check_decode(windowed, q, kc, vc, tables, lens, None, 37, what="split fp32, window, graph bound")


def test_paged_decode_kernel_split_count_alone_sets_the_sums(kdevice):
    """A given num_splits launches exactly that many splits whatever max_seqlen says: an engine's eager step
    (bounded by its own context) and its decode graph (bounded by max_model_len) pass the same count and must
    get the same bits; and a count beyond what the context fills still sums every key."""
    from anygpu.kernels.paged_decode import paged_decode as kernel

    seqlens, q_heads, kv_heads = decode_shape(kdevice)
    q, kc, vc, tables, lens, max_seqlen = paged_case(seqlens, q_heads, kv_heads, 64, 16, torch.float32, kdevice)
    capacity = tables.shape[1] * 16
    for splits in (3, 6, 16):
        tight = kernel(q, kc, vc, tables, lens, max_seqlen // 2, num_splits=splits)
        loose = kernel(q, kc, vc, tables, lens, capacity, num_splits=splits)
        assert torch.equal(bits(tight), bits(loose)), f"{splits} splits"
        check_decode(tight, q, kc, vc, tables, lens, what=f"{splits} splits")
    many = kernel(q, kc, vc, tables, lens, 16, num_splits=64)  # more splits than granules of the longest context
    check_decode(many, q, kc, vc, tables, lens, what="64 splits, bound 16")


def _no_second_launch(monkeypatch, pd):
    """The reduce kernel, made to fail if launched: the decode kernel must combine its splits itself."""
    class Forbidden:
        def __getitem__(self, grid):
            raise AssertionError("the decode kernel should have combined its splits itself")

    monkeypatch.setattr(pd, "_paged_decode_reduce_kernel", Forbidden())


def _ragged_split_case(device, q_heads, kv_heads, head_dim, dtype=torch.bfloat16):
    """Sequences of very different lengths under one forced split count: the longest uses all 10 splits (more
    than one unrolled step of the combine, not a multiple of it), a short one 1 (the other 9 programs of its
    sequence get no key), an empty one none."""
    seqlens = [5, 0, 150, 70] if device.type != "cuda" else [5, 0, 4099, 1000, 17]
    return paged_case(seqlens, q_heads, kv_heads, head_dim, 16, dtype, device)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,window_left,softcap",
                         [(8, 2, 64, -1, 0.0), (16, 2, 80, 20, 2.5)])  # the second: 640 elements per group, so
def test_paged_decode_kernel_merges_splits_as_the_reduce_launch_did(  # the combine runs two blocks; D not 2**k
        kdevice, monkeypatch, q_heads, kv_heads, head_dim, window_left, softcap):
    """The last split program of each (sequence, KV head) combines the partials: the same bits as the separate
    reduce launch (the CUDA-graph capture fallback), every call, with the counters left at 0."""
    from anygpu.kernels import _split_k
    from anygpu.kernels import paged_decode as pd
    from anygpu.kernels.launch import device_target, select

    q, kc, vc, tables, lens, max_seqlen = _ragged_split_case(kdevice, q_heads, kv_heads, head_dim)
    tile = select(pd.CONFIGS, device_target(kdevice))[0].constexprs["TILE_N"]
    assert pd.fixed_splits(max_seqlen, 10, math.lcm(tile, 16)).num_splits == 10

    def run():  # the combines of targets without PDL (forced off: a Hopper GPU would run the wide one)
        return pd.paged_decode(q, kc, vc, tables, lens, max_seqlen, None, window_left, softcap, num_splits=10,
                               wide_combine=False)

    with monkeypatch.context() as mp:
        mp.setattr(pd, "counters", lambda device, tiles: None)  # as under capture without counters
        reduced = run()
    with monkeypatch.context() as mp:
        _no_second_launch(mp, pd)
        first, second = run(), run()  # the second proves the first left its counters at 0
    assert torch.equal(bits(first), bits(reduced)) and torch.equal(bits(second), bits(reduced))
    assert not _split_k._COUNTERS[q.device].any()
    check_decode(first, q, kc, vc, tables, lens, None, window_left, softcap, what="merged in the kernel")


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,window_left,softcap",
                         [(8, 2, 64, -1, 0.0), (16, 2, 80, 20, 2.5)])  # the second: D not a multiple of the tile
def test_paged_decode_wide_combine_sums_every_split(kdevice, q_heads, kv_heads, head_dim, window_left, softcap):
    """The wide second launch (targets with PDL): every split of a ragged batch combined, several tiles of splits
    (the interpreter's 4 a step; 70 splits on a GPU's 64), in fp32 as the single pass does, and in bf16 with the
    same bits on every call."""
    from anygpu.kernels import paged_decode as pd

    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, tables, lens, max_seqlen = _ragged_split_case(kdevice, q_heads, kv_heads, head_dim, dtype)
        single = pd.paged_decode(q, kc, vc, tables, lens, max_seqlen, None, window_left, softcap, num_splits=1)
        for splits in (3, 10) if kdevice.type != "cuda" else (10, 70):
            def run():
                return pd.paged_decode(q, kc, vc, tables, lens, max_seqlen, None, window_left, softcap,
                                       num_splits=splits, wide_combine=True)

            wide = run()
            what = f"{dtype} {splits} splits, combined wide"
            check_decode(wide, q, kc, vc, tables, lens, None, window_left, softcap, what=what)
            if dtype == torch.float32:
                torch.testing.assert_close(wide, single, rtol=1e-5, atol=1e-5, msg=what)
            assert torch.equal(bits(run()), bits(wide)), what


def test_paged_decode_combine_weights_each_split_by_its_log2_sum_exp(kdevice):
    """The wide combine alone, on partials made here: each split weighted by 2^lse, empty splits (lse -inf) left
    out, a row with no key at all 0, more splits than one tile holds (11 > the interpreter's 4, 70 > a GPU's 64),
    a head dim that is not a multiple of the dim tile."""
    from anygpu.kernels.paged_decode_combine import combine_splits

    gen = torch.Generator().manual_seed(0)
    for splits in (2, 11, 70):
        part = torch.randn(2, 3, splits, 80, generator=gen)
        lse = torch.randn(2, 3, splits, generator=gen) * 4
        lse[0, 0, 1:] = float("-inf")  # one split holds keys
        lse[1, 2] = float("-inf")  # none does: the row is 0
        top = lse.amax(-1, keepdim=True)
        w = torch.exp2(lse - torch.where(top == float("-inf"), 0.0, top))
        total = w.sum(-1, keepdim=True)
        want = (w.unsqueeze(-1) * part).sum(-2) / torch.where(total == 0, 1.0, total)
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full((2, 3, 80), float("nan"), dtype=dtype, device=kdevice)
            combine_splits(part.to(kdevice), lse.to(kdevice), out)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.float().cpu(), want, rtol=tol, atol=tol, msg=f"{splits} splits, {dtype}")
            assert (out[1, 2] == 0).all()
            if dtype == torch.float32:  # one split with keys: its partial exactly (weight 1, the others 0)
                assert torch.equal(out[0, 0].cpu(), part[0, 0, 0])


def test_paged_decode_unsplit_call_makes_the_counters(kdevice, monkeypatch):
    """A warm-up step that does not split still makes the device's counters, so a decode graph captured later
    with splits combines them in the kernel."""
    from anygpu.kernels import _split_k
    from anygpu.kernels.paged_decode import paged_decode as kernel

    monkeypatch.setattr(_split_k, "_COUNTERS", {})
    q, kc, vc, tables, lens, max_seqlen = paged_case([9, 3], 4, 2, 64, 16, torch.float16, kdevice)
    kernel(q, kc, vc, tables, lens, max_seqlen, num_splits=1, wide_combine=False)  # (PDL targets use none)
    assert _split_k._COUNTERS[q.device].numel() >= _split_k.MIN_COUNTERS


@pytest.mark.gpu
def test_paged_decode_merged_splits_in_a_cuda_graph_are_deterministic(monkeypatch):
    """Eager, five times, and a captured graph replayed three times: the same bits; and a graph captured without
    counters (the fallback's second launch) the same bits too."""
    from anygpu.kernels import _split_k
    from anygpu.kernels import paged_decode as pd

    q, kc, vc, tables, lens, max_seqlen = _ragged_split_case(torch.device("cuda"), 32, 8, 128)
    assert pd.plan_splits(5, 8, max_seqlen, pd._device_state(q.device)[0], 64).num_splits > 1

    def run(splits=None):
        return pd.paged_decode(q, kc, vc, tables, lens, max_seqlen, num_splits=splits)

    wide = pd.uses_wide_combine(q.device)  # Hopper on: every split launch is combined by the second, wide one
    for splits in (None, 10):
        with monkeypatch.context() as mp:
            if not wide:
                _no_second_launch(mp, pd)
            eager = run(splits)
            for _ in range(4):
                assert torch.equal(bits(run(splits)), bits(eager)), f"splits {splits}: not deterministic"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run(splits)
            for _ in range(3):
                out.zero_()
                graph.replay()
                assert torch.equal(bits(out), bits(eager)), f"splits {splits}: replay differs from eager"
        assert not _split_k._COUNTERS.get(q.device, torch.zeros(1)).any()
        check_decode(eager, q, kc, vc, tables, lens, what=f"splits {splits}")
        with monkeypatch.context() as mp:
            mp.setattr(pd, "counters", lambda device, tiles: None)
            assert torch.equal(bits(run(splits)), bits(eager))  # the fallback, compiled outside the capture
            fallback = torch.cuda.CUDAGraph()
            with torch.cuda.graph(fallback):
                out = run(splits)
            fallback.replay()
            assert torch.equal(bits(out), bits(eager)), f"splits {splits}: the captured fallback differs"


def test_paged_decode_kernel_strided_q_and_empty_batch(kdevice):
    from anygpu.kernels.paged_decode import paged_decode as kernel

    q, kc, vc, tables, lens, max_seqlen = paged_case([40, 3], 4, 2, 64, 16, torch.bfloat16, kdevice)
    fused = torch.randn(2, (4 + 2 * 2) * 64, device=kdevice).to(torch.bfloat16)
    fused[:, :4 * 64] = q.reshape(2, -1)
    q_view = fused[:, :4 * 64].view(2, 4, 64)  # batch stride 512, not 256
    torch.testing.assert_close(kernel(q_view, kc, vc, tables, lens, max_seqlen), kernel(q, kc, vc, tables, lens,
                                                                                        max_seqlen), rtol=0, atol=0)
    assert kernel(q[:0], kc, vc, tables[:0], lens[:0], 0).shape == (0, 4, 64)


# --- the split plan (pure) -------------------------------------------------------------------------------


def test_plan_splits():
    from anygpu.kernels.paged_decode import (FILL, MIN_PARTITION, SHORT_FROM, SHORT_PARTITION, SHORT_SPLITS,
                                             SplitPlan, fixed_splits, plan_splits)

    h200, mi300x = 132, 304
    assert plan_splits(64, 8, 4096, h200, 64) == SplitPlan(1, 0)  # 512 programs already fill the GPU
    assert plan_splits(1, 8, 32768, h200, 64) == SplitPlan(64, 512)  # 8 programs -> 512, capped by MIN_PARTITION
    assert plan_splits(8, 8, 8192, h200, 64) == SplitPlan(8, 1024)  # 64 programs -> 512
    assert plan_splits(32, 8, 4096, h200, 64) == SplitPlan(2, 2048)  # 256 programs: under 2 per CU
    assert plan_splits(1, 8, 32768, mi300x, 64) == SplitPlan(64, 512)  # capped by MIN_PARTITION
    assert plan_splits(1, 8, 8192, h200, 64) == SplitPlan(16, 512)  # a decode graph at max_model_len 8192
    assert plan_splits(1, 8, 2048, h200, 64) == SplitPlan(16, 128)  # short: SHORT_SPLITS of >= SHORT_PARTITION
    assert plan_splits(1, 8, 400, h200, 64) == SplitPlan(4, 128)  # 6 wanted, whole granules leave 4
    assert plan_splits(8, 8, 2048, h200, 64) == SplitPlan(8, 256)  # 64 programs -> 512
    assert plan_splits(1, 8, SHORT_FROM - 1, h200, 64) == SplitPlan(1, 0)  # too short to split
    assert plan_splits(0, 8, 4096, h200, 64) == SplitPlan(1, 0)
    for batch, heads, seqlen, cus, granule in [(1, 1, 100000, 132, 64), (3, 8, 5000, 80, 48), (2, 4, 131072, 304, 16),
                                               (16, 8, 4096, 132, 64), (5, 2, 2049, 20, 32), (1, 8, 700, 132, 64),
                                               (2, 8, 300, 304, 32)]:
        plan = plan_splits(batch, heads, seqlen, cus, granule)
        if plan.num_splits > 1:
            assert plan.partition_size % granule == 0 and plan.partition_size >= SHORT_PARTITION
            assert plan.num_splits <= SHORT_SPLITS or plan.partition_size >= MIN_PARTITION
            assert (plan.num_splits - 1) * plan.partition_size < seqlen <= plan.num_splits * plan.partition_size
            assert batch * heads * (plan.num_splits - 1) < FILL * cus  # no more splits than it takes
    assert fixed_splits(100, 3, 16) == SplitPlan(3, 48)
    assert fixed_splits(100, 1, 16) == SplitPlan(1, 0)
    assert fixed_splits(10, 4, 16) == SplitPlan(1, 0)
    assert fixed_splits(33, 4, 16) == SplitPlan(3, 16)  # rounding to the granule can leave fewer splits


# --- paged decode: the op --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_opcheck(device, dtype):
    q, kc, vc, tables, lens, max_seqlen = paged_case([9, 0, 20], 4, 2, 32, 8, dtype, torch.device(device))
    torch.library.opcheck(paged_decode.overload, (q, kc, vc, tables, lens, max_seqlen, 0.25, 4, 10.0))
    torch.library.opcheck(paged_decode.overload, (q, kc, vc, tables, lens, max_seqlen))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window_left,softcap", [(-1, 0.0), (5, 0.0), (-1, 3.0), (0, 0.0), (12, 2.0)])
@pytest.mark.parametrize("q_heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_paged_decode_cpu_implementation_is_accurate(dtype, window_left, softcap, q_heads, kv_heads):
    """The CPU implementation (sequence by sequence, only the live rows gathered) against the fp64 oracle, by
    the accuracy rule, with NaN in every unused slot and GARBAGE_BLOCK in every unused table entry; lengths of
    0, 1, a whole block and one past it."""
    from anygpu.ops.paged_decode import cpu_decode

    q, kc, vc, tables, lens, max_seqlen = paged_case([19, 1, 0, 33, 8, 9], q_heads, kv_heads, 16, 8, dtype, "cpu")
    out = cpu_decode(q, kc, vc, tables, lens, max_seqlen, 0.3, window_left, softcap)
    check_decode(out, q, kc, vc, tables, lens, 0.3, window_left, softcap, what="cpu_decode")
    tolerance = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(out.double(), naive_decode(q, kc, vc, tables, lens, 0.3, window_left, softcap),
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window_left", [-1, 5])
def test_paged_decode_cpu_implementation_reads_consecutive_blocks_in_place(window_left):
    """Blocks a sequence holds in order are read as a view of the cache, not gathered: the same accuracy, and a
    run of consecutive entries past the cache's last block still names block_tables (a slice would clip it)."""
    from anygpu.ops.paged_decode import cpu_decode

    q, kc, vc, tables, lens, max_seqlen = paged_case([19, 1, 0, 33, 8], 4, 2, 16, 8, torch.float32, "cpu",
                                                     in_order=True)
    assert tables[3, :5].tolist() == list(range(int(tables[3, 0]), int(tables[3, 0]) + 5))  # the in-place path
    out = cpu_decode(q, kc, vc, tables, lens, max_seqlen, 0.3, window_left)
    torch.testing.assert_close(out.double(), naive_decode(q, kc, vc, tables, lens, 0.3, window_left, 0.0),
                               rtol=1e-5, atol=1e-5)
    num_blocks = kc.shape[0]
    tables[3, :5] = torch.arange(num_blocks - 3, num_blocks + 2, dtype=torch.int32)  # consecutive, 2 past the end
    with pytest.raises(ValueError, match="block_tables: row 3 names a block outside the cache's"):
        cpu_decode(q, kc, vc, tables, lens, max_seqlen)


def test_paged_decode_cpu_implementation_reads_up_to_the_bound_and_names_a_bad_block():
    """A max_seqlen under a length caps the positions read, as in the reference; a table entry naming no block,
    within the positions read, is a ValueError naming block_tables (the reference would clamp it)."""
    from anygpu.ops.paged_decode import cpu_decode

    q, kc, vc, tables, lens, _ = paged_case([19, 5, 33], 4, 2, 16, 8, torch.float32, "cpu")
    for bound in (8, 16, 17):
        torch.testing.assert_close(cpu_decode(q, kc, vc, tables, lens, bound),
                                   decode_reference(q, kc, vc, tables, lens, bound), rtol=1e-5, atol=1e-6)
    tables[2, 1] = kc.shape[0]
    with pytest.raises(ValueError, match="block_tables: row 2 names a block outside the cache's"):
        paged_decode(q, kc, vc, tables, lens, 33)


def test_paged_decode_op_on_cpu_runs_the_cpu_implementation_and_compiles():
    from anygpu.ops.paged_decode import cpu_decode

    q, kc, vc, tables, lens, max_seqlen = paged_case([9, 0, 20], 4, 2, 32, 8, torch.bfloat16, "cpu")
    out = paged_decode(q, kc, vc, tables, lens, max_seqlen)
    assert torch.equal(out, cpu_decode(q, kc, vc, tables, lens, max_seqlen))
    assert torch.equal(paged_decode.overload(q, kc, vc, tables, lens, max_seqlen), out)  # the dispatcher's too
    check_decode(out, q, kc, vc, tables, lens, what="cpu op")
    compiled = torch.compile(lambda *a: paged_decode(*a), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, kc, vc, tables, lens, max_seqlen), out, rtol=0, atol=0)
    meta = paged_decode(*(t.to("meta") if isinstance(t, torch.Tensor) else t
                          for t in (q, kc, vc, tables, lens, max_seqlen)))
    assert meta.shape == q.shape and meta.dtype == q.dtype and meta.device.type == "meta"


def test_paged_decode_bad_arguments_name_the_argument():
    q, kc, vc, tables, lens, _ = paged_case([9, 3], 4, 2, 32, 8, torch.float16, "cpu")
    cases = [
        ((q[0], kc, vc, tables, lens, 9), r"q: expected shape \[batch, num_q_heads, head_dim\]"),
        ((q.int(), kc, vc, tables, lens, 9), "q: expected dtype float16, bfloat16 or float32"),
        ((torch.zeros(2, 4, 512, dtype=torch.float16), kc, vc, tables, lens, 9), "q: expected a head_dim of at most"),
        ((q, kc[..., :16], vc, tables, lens, 9), r"key_cache: expected shape \[num_blocks, block_size, num_kv_heads"),
        ((q, kc, vc.float(), tables, lens, 9), "value_cache: expected q's dtype torch.float16"),
        ((q, kc, vc[:1], tables, lens, 9), "value_cache: expected key_cache's shape"),
        ((q[:, :3], kc, vc, tables, lens, 9), "key_cache: expected num_kv_heads dividing q's 3 heads, got 2"),
        ((q, kc, vc, tables.long(), lens, 9), r"block_tables: expected int32 of shape \[2, max_blocks_per_seq\]"),
        ((q, kc, vc, tables, lens.long(), 9), r"seqlens: expected int32 of shape \[2\]"),
        ((q, kc, vc, tables, lens, 10 ** 6), r"max_seqlen: expected an int in \[0, max_blocks_per_seq"),
        ((q, kc, vc, tables, lens, -1), "max_seqlen: expected an int"),
        ((q, kc, vc, tables, lens, 9, float("nan")), "scale: expected a finite float"),
        ((q, kc, vc, tables, lens, 9, None, -2), "window_left: expected an int >= -1"),
        ((q, kc, vc, tables, lens, 9, None, -1, -1.0), "softcap: expected a finite float >= 0"),
        ((q, kc, vc, tables, lens.to("meta"), 9), "seqlens: expected q, key_cache, value_cache, block_tables and"),
        ((q, kc, vc, tables, lens, 9, None, -1, 0.0, 0), r"num_splits: expected None or an int in \[1, 1024\]"),
        ((q, kc, vc, tables, lens, 9, None, -1, 0.0, 10 ** 6), r"num_splits: expected None or an int in"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_decode(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_gpu_dispatch_runs_the_triton_kernel(dtype, monkeypatch):
    from anygpu.kernels.paged_decode import paged_decode as kernel

    q, kc, vc, tables, lens, max_seqlen = paged_case([700, 1, 0, 2100], 16, 4, 128, 16, dtype, "cuda")
    out = paged_decode(q, kc, vc, tables, lens, max_seqlen)
    torch.testing.assert_close(out, kernel(q, kc, vc, tables, lens, max_seqlen), rtol=0, atol=0)
    monkeypatch.setenv("ANYGPU_KERNELS", "reference")
    check_decode(paged_decode(q, kc, vc, tables, lens, max_seqlen), q, kc, vc, tables, lens, what="reference on gpu")


@pytest.mark.gpu
def test_paged_decode_and_cache_write_capture_in_a_cuda_graph():
    """No host synchronisation: both ops capture into a graph, and replays follow new seqlens and slots."""
    q, kc, vc, tables, lens, max_seqlen = paged_case([3000, 1, 515], 32, 8, 128, 16, torch.bfloat16, "cuda")
    lens_now = lens - 1  # the graph's inputs: the current token is written, then attended to
    key, value = fused_kv(3, 8, 128, torch.bfloat16, "cuda")
    blocks = tables.gather(1, (lens_now // 16).long()[:, None])[:, 0].long()
    slots = blocks * 16 + (lens_now % 16).long()
    for _ in range(2):  # warm up: compiles outside the capture
        reshape_and_cache(key, value, kc, vc, slots)
        paged_decode(q, kc, vc, tables, lens, max_seqlen)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reshape_and_cache(key, value, kc, vc, slots)
        out = paged_decode(q, kc, vc, tables, lens, max_seqlen)
    lens.sub_(1)
    slots.fill_(-1)
    graph.replay()
    check_decode(out, q, kc, vc, tables, lens, what="graph replay")
