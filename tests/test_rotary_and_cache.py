"""rotary_and_cache: rotary embedding on q and k in place plus the paged KV cache write, in one launch.

The kernel (GPU, or the CPU in Triton's interpreter) against the two kernels it replaces (rotary_embedding's,
then reshape_and_cache's), bit for bit: the same fp32 expressions rounded once, and bit-exact copies.  Under
the interpreter the rotation also equals the references bit for bit except in bf16 (the interpreter truncates
fp32 -> bf16 where torch rounds to nearest).  The op: opcheck, meta, torch.compile, argument errors.
Unused cache slots hold NaN, so a stray or a missing write fails the bit comparison.
"""

from __future__ import annotations

import pytest
import torch

from anygpu.ops import reshape_and_cache, rotary_and_cache, rotary_embedding
from anygpu.ops.rotary_and_cache import reference
from anygpu.ops.rotary_embedding import rotary_cos_sin_cache
from anygpu.testing import interpreter_active

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GPU = pytest.param("cuda", marks=pytest.mark.gpu)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so NaN payloads and -0.0 compare exactly."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def case(tokens, q_heads, kv_heads, head_dim, rot_dim, dtype, device, block_size=4, num_blocks=4, padded=(1,)):
    """(qkv, args): q, k, v as views of one fused [T, (Hq + 2 Hkv) * D] projection output (the model's case:
    token stride != heads * D), the caches as views of one stacked [2, ...] NaN-filled tensor."""
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device=device) * 2).to(dtype)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    max_position = 64
    positions = torch.randint(0, max_position, (tokens,), device=device)
    positions[0] = max_position - 1
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[[p for p in padded if p < tokens]] = -1
    kv = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    cos_sin = rotary_cos_sin_cache(rot_dim, max_position, device=device)
    return qkv, [positions, q, k, v, cos_sin, True, kv[0], kv[1], slots]


def views_like(args, qkv, new_qkv):
    """``args`` with q, k, v re-pointed at the same offsets of ``new_qkv`` (a clone of ``qkv``)."""
    out = list(args)
    for i in (1, 2, 3):
        t = args[i]
        out[i] = new_qkv.as_strided(t.shape, t.stride(), t.storage_offset() - qkv.storage_offset())
    return out


def two_ops(args, rotary=None, cache_write=None):
    """rotary_embedding then reshape_and_cache on ``args`` (each op, or the given kernels)."""
    positions, q, k, v, cos_sin, is_neox, key_cache, value_cache, slots = args
    (rotary or rotary_embedding)(positions, q, k, cos_sin, is_neox)
    (cache_write or reshape_and_cache)(k, v, key_cache, value_cache, slots)


def cloned(qkv, args):
    """A deep copy of (qkv, args): q, k, v views of the copied qkv, the caches fresh copies."""
    qkv2 = qkv.clone()
    out = views_like(args, qkv, qkv2)
    out[6], out[7] = args[6].clone(), args[7].clone()
    return qkv2, out


def assert_same_bits(got, want, what):
    for name, a, b in zip(("qkv", "key_cache", "value_cache"), got, want):
        assert torch.equal(bits(a), bits(b)), f"{what}: {name} differs"


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rot_dim", [((4, 2), 64, 64), ((3, 1), 80, 32), ((6, 6), 32, 16)],
                         ids=["gqa", "mqa-partial", "mha-partial"])
def test_kernel_equals_the_two_kernels_bit_for_bit(kdevice, dtype, is_neox, heads, head_dim, rot_dim):
    from anygpu.kernels.kv_cache import reshape_and_cache as cache_kernel
    from anygpu.kernels.rotary_and_cache import rotary_and_cache as kernel
    from anygpu.kernels.rotary_embedding import rotary_embedding as rotary_kernel

    qkv, args = case(5, *heads, head_dim, rot_dim, dtype, kdevice, padded=(1, 3))
    args[5] = is_neox
    qkv_two, args_two = cloned(qkv, args)
    qkv_ref, args_ref = cloned(qkv, args)
    before = qkv.clone()
    kernel(*args)
    two_ops(args_two, rotary_kernel, cache_kernel)
    what = f"{dtype} neox={is_neox} {heads} {head_dim}/{rot_dim}"
    assert_same_bits((qkv, args[6], args[7]), (qkv_two, args_two[6], args_two[7]), what)
    q_end = heads[0] * head_dim
    assert torch.equal(bits(qkv[:, q_end + heads[1] * head_dim:]), bits(before[:, q_end + heads[1] * head_dim:]))
    # Padded tokens (slots 1 and 3) are rotated but leave the cache alone: only the named slots were written.
    written = args[8][args[8] >= 0]
    key_rows = args[6].reshape(-1, heads[1], head_dim)
    assert key_rows[written].isnan().sum() == 0 and key_rows.isnan().all(-1).all(-1).sum() == key_rows.shape[0] - 3
    assert torch.equal(bits(key_rows[written]), bits(args[2][args[8] >= 0]))  # the cache holds the rotated key
    reference(*args_ref)
    if interpreter_active() and dtype != torch.bfloat16:  # the interpreter rounds as torch does but for bf16
        assert_same_bits((qkv, args[6], args[7]), (qkv_ref, args_ref[6], args_ref[7]), what + " vs reference")
    else:  # bf16 truncation (interpreter), fused multiply-adds (GPU): the same math within an ulp
        ulp = torch.finfo(dtype).eps * 2
        torch.testing.assert_close(qkv, qkv_ref, rtol=ulp, atol=ulp * float(qkv_ref.abs().max()))


def test_kernel_strides_padding_and_empty(kdevice):
    """Separate q/k/v with token and head strides of their own, v without unit stride on D (copied), all-padding
    slots, no tokens, and a cache of no blocks (nothing to write): each as the two kernels do."""
    from anygpu.kernels.kv_cache import reshape_and_cache as cache_kernel
    from anygpu.kernels.rotary_and_cache import rotary_and_cache as kernel
    from anygpu.kernels.rotary_embedding import rotary_embedding as rotary_kernel

    dtype, tokens, head_dim = torch.bfloat16, 4, 32
    q = torch.randn(tokens, 3, head_dim + 16, device=kdevice).to(dtype)[..., :head_dim]
    k = torch.randn(2 * tokens, 2, 2 * head_dim, device=kdevice).to(dtype)[::2, :, head_dim:]
    v = torch.randn(tokens, head_dim, 2, device=kdevice).to(dtype).transpose(1, 2)
    assert q.stride(1) != head_dim and k.stride(0) != 2 * head_dim and v.stride(-1) != 1
    positions = torch.tensor([3, 0, 15, 7], device=kdevice)
    cos_sin = rotary_cos_sin_cache(head_dim, 16, device=kdevice)
    for slots in (torch.tensor([5, -1, 0, 9], device=kdevice), torch.full((tokens,), -1, device=kdevice)):
        kv = torch.full((2, 3, 4, 2, head_dim), float("nan"), dtype=dtype, device=kdevice)
        q1, k1, kv1 = q.clone(), k.clone(), kv.clone()
        kernel(positions, q, k, v, cos_sin, False, kv[0], kv[1], slots)
        rotary_kernel(positions, q1, k1, cos_sin, False)
        cache_kernel(k1, v, kv1[0], kv1[1], slots)
        assert torch.equal(bits(q), bits(q1)) and torch.equal(bits(k), bits(k1)) and torch.equal(bits(kv), bits(kv1))
    no_cache = torch.empty(0, 4, 2, head_dim, dtype=dtype, device=kdevice)
    k0 = k.clone()
    kernel(positions, q, k, v, cos_sin, True, no_cache, no_cache.clone(), torch.tensor([0, 1, 2, 3], device=kdevice))
    assert not torch.equal(k, k0)  # still rotated, and nothing written (there is nowhere to write)
    empty = torch.empty(0, 2, head_dim, dtype=dtype, device=kdevice)
    kernel(positions[:0], empty, empty, empty, cos_sin, True, kv[0], kv[1], slots[:0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_equals_the_two_ops(dtype):
    """On the CPU: the op is rotary_embedding then reshape_and_cache, bit for bit."""
    qkv, args = case(6, 4, 2, 32, 16, dtype, "cpu", padded=(0, 4))
    qkv_two, args_two = cloned(qkv, args)
    assert rotary_and_cache(*args) is None
    two_ops(args_two)
    assert_same_bits((qkv, args[6], args[7]), (qkv_two, args_two[6], args_two[7]), str(dtype))


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rot_dim", [((4, 2), 64, 64), ((3, 1), 80, 32), ((6, 6), 32, 16)],
                         ids=["gqa", "mqa-partial", "mha-partial"])
@pytest.mark.parametrize("tokens,fused", [(7, True), (1, True), (7, False)])
def test_cpu_implementation_equals_the_references_bit_for_bit(dtype, is_neox, heads, head_dim, rot_dim, tokens,
                                                                fused):
    """What the CPU runs (``cpu``: per-step cos/sin tables, one multiply-add a tensor, q and k as one tensor when
    they are views of one QKV output, then ``cpu_write``) against the two references; padding first and in the
    middle.  ``fused=False``: q and k are separate tensors (as after Qwen3's q/k norm)."""
    from anygpu.ops.reshape_and_cache import reference as cache_reference
    from anygpu.ops.rotary_and_cache import cpu
    from anygpu.ops.rotary_embedding import _heads_together
    from anygpu.ops.rotary_embedding import reference as rotary_reference

    qkv, args = case(tokens, *heads, head_dim, rot_dim, dtype, "cpu", padded=(0, 3) if tokens > 1 else ())
    args[5] = is_neox
    if not fused:
        args[1], args[2] = args[1].clone(), args[2].clone()
    assert len(_heads_together(args[1], args[2])) == (1 if fused else 2)
    qkv_ref, args_ref = cloned(qkv, args)
    if not fused:
        args_ref[1], args_ref[2] = args[1].clone(), args[2].clone()
    cpu(*args)
    two_ops(args_ref, rotary_reference, cache_reference)
    assert_same_bits((qkv, args[6], args[7]), (qkv_ref, args_ref[6], args_ref[7]), "cpu vs references")
    for mine, theirs in zip(args[1:3], args_ref[1:3]):
        assert torch.equal(bits(mine), bits(theirs)), "q or k"


def test_cpu_step_tables_follow_positions_and_tables():
    """The CPU rotation reuses a step's cos/sin tables while the positions and the table are the same: positions
    changed in place, or equal positions with another table (Gemma 3's two), or the table changed in place,
    must each give the reference's rotation."""
    from anygpu.ops.rotary_embedding import cpu_rotate
    from anygpu.ops.rotary_embedding import reference as rotary_reference

    _, args = case(5, 4, 2, 32, 32, torch.float32, "cpu")
    positions, q, k, _, table = args[:5]
    other = rotary_cos_sin_cache(32, 64, base=500.0)
    for step in range(4):
        if step == 1:
            positions.sub_(1).clamp_(min=0)  # the same tensor, new values: a new step
        if step == 3:
            table.mul_(0.5)  # the same table, changed in place
        for t in (table, other, table):
            q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
            cpu_rotate(positions, q1, k1, t, True)
            rotary_reference(positions, q2, k2, t, True)
            assert torch.equal(bits(q1), bits(q2)) and torch.equal(bits(k1), bits(k2)), f"step {step}"


def test_cpu_rotation_with_an_inference_mode_table():
    """A table made under inference mode has no version counter: the CPU rotation then builds its tables every
    call (an in-place change could not be seen), with the reference's bits, inside and outside inference mode."""
    from anygpu.ops.rotary_embedding import cpu_rotate
    from anygpu.ops.rotary_embedding import reference as rotary_reference

    with torch.inference_mode():
        table = rotary_cos_sin_cache(32, 64)
        positions = torch.tensor([3, 9, 63])
        q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)
        for step in range(2):
            table.mul_(0.5 if step else 1.0)  # allowed on an inference tensor, and not versioned
            q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
            cpu_rotate(positions, q1, k1, table, True)
            rotary_reference(positions, q2, k2, table, True)
            assert torch.equal(bits(q1), bits(q2)) and torch.equal(bits(k1), bits(k2)), step


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    _, args = case(5, 4, 2, 32, 32, dtype, torch.device(device))
    torch.library.opcheck(rotary_and_cache.overload, args)


def test_meta_and_compile():
    _, args = case(4, 4, 2, 32, 32, torch.bfloat16, "cpu")
    assert rotary_and_cache(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]) is None
    qkv2, args2 = cloned(*case(4, 4, 2, 32, 32, torch.bfloat16, "cpu"))
    qkv3, args3 = cloned(qkv2, args2)
    rotary_and_cache(*args2)
    compiled = torch.compile(lambda *a: rotary_and_cache(*a), fullgraph=True, backend="aot_eager")
    compiled(*args3)  # functionalized, then copied back into q, k and the caches
    assert_same_bits((qkv3, args3[6], args3[7]), (qkv2, args2[6], args2[7]), "compiled")


def test_bad_arguments_name_the_argument():
    _, args = case(5, 4, 2, 32, 16, torch.float16, "cpu")
    positions, q, k, v, cos_sin, is_neox, key_cache, value_cache, slots = args

    def call(**changed):
        named = dict(positions=positions, query=q, key=k, value=v, cos_sin_cache=cos_sin, is_neox=is_neox,
                     key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
        return rotary_and_cache(**{**named, **changed})

    bad = [
        (dict(value=v.float()), r"value: expected torch.float16 of key's shape \(5, 2, 32\)"),
        (dict(value=v[:, :1]), r"value: expected torch.float16 of key's shape"),
        (dict(key=k.float()), r"key: expected a torch.float16 tensor \[5, kv_heads, 32\]"),
        (dict(key=k[:4]), r"key: expected a torch.float16 tensor \[5, kv_heads, 32\]"),
        (dict(query=q.reshape(5, -1)), r"query: expected a float16, bfloat16 or float32 tensor \[tokens, heads"),
        (dict(query=q.transpose(1, 2)), "query: expected .* unit stride on head_dim"),
        (dict(positions=positions.int()), r"positions: expected an int64 tensor \[5\]"),
        (dict(cos_sin_cache=cos_sin.half()), "cos_sin_cache: expected a float32 tensor"),
        (dict(cos_sin_cache=rotary_cos_sin_cache(64, 8)), "cos_sin_cache: expected .* <= head_dim 32"),
        (dict(slot_mapping=slots.int()), r"slot_mapping: expected int64 of shape \[5\]"),
        (dict(slot_mapping=slots[:4]), r"slot_mapping: expected int64 of shape \[5\]"),
        (dict(key_cache=key_cache.float()), "key_cache: expected key's dtype torch.float16, got torch.float32"),
        (dict(key_cache=key_cache[..., :16]), r"key_cache: expected shape \[num_blocks, block_size, 2, 32\]"),
        (dict(value_cache=value_cache[:2]), r"value_cache: expected key_cache's shape"),
        (dict(value_cache=value_cache.transpose(2, 3)), "value_cache: expected shape"),
    ]
    for changed, message in bad:
        with pytest.raises(ValueError, match=message):
            call(**changed)
    with pytest.raises(TypeError, match="rotary_and_cache: value: expected a torch.Tensor, got list"):
        call(value=[[1.0]])
    # Nothing was written by the refused calls.
    assert key_cache.isnan().all() and value_cache.isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim,rot_dim", [(1, (32, 8), 128, 128), (300, (32, 8), 128, 128),
                                                           (37, (12, 4), 96, 48), (64, (16, 16), 64, 64)])
def test_gpu_op_equals_the_two_ops(dtype, is_neox, tokens, heads, head_dim, rot_dim):
    """On the GPU (the Triton kernels): the op equals rotary_embedding then reshape_and_cache, bit for bit,
    at Llama-8B's decode and prefill shapes, partial rotary, and MHA."""
    qkv, args = case(tokens, *heads, head_dim, rot_dim, dtype, torch.device("cuda"), block_size=16,
                     num_blocks=max(4, tokens // 8), padded=(1, tokens // 2) if tokens > 1 else ())
    args[5] = is_neox
    qkv_two, args_two = cloned(qkv, args)
    rotary_and_cache(*args)
    two_ops(args_two)
    torch.cuda.synchronize()
    assert_same_bits((qkv, args[6], args[7]), (qkv_two, args_two[6], args_two[7]),
                     f"{dtype} neox={is_neox} T={tokens} {heads} {head_dim}/{rot_dim}")
