"""RMSNorm (+ fused residual add), GELU-and-mul and rotary embedding: kernels (GPU, or the CPU in Triton's
interpreter) and ops (registration, references, errors, autograd, fake tensors).

Oracles are written here from HF transformers' formulas (LlamaRMSNorm, F.gelu, apply_rotary_pos_emb
with rotate_half, GPT-J's rotate_every_two, rope_type "llama3"), not imported from anywhere.

The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest even): its error bound is
twice round-to-nearest's, so under the interpreter, for bf16 only, the accuracy rule's bound doubles (4x
PyTorch's error, and two ulps where PyTorch is exact) and "same math" comparisons allow one more ulp.
RMSNorm rounds twice (the normalized row, then the product with the weight), and two truncations do pass
2x PyTorch's error.  On GPUs the rule is the house's: 2x.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from anygpu.ops import fused_add_rms_norm, gelu_and_mul, rms_norm, rotary_embedding
from anygpu.ops.fused_add_rms_norm import reference as fused_reference
from anygpu.ops.gelu_and_mul import reference as gelu_reference
from anygpu.ops.rms_norm import reference as rms_reference
from anygpu.ops.rotary_embedding import reference as rotary_reference
from anygpu.ops.rotary_embedding import rotary_cos_sin_cache
from anygpu.testing import assert_accurate, error_report, interpreter_active, kernel_device, poison_, reference_dtype

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GPU = pytest.param("cuda", marks=pytest.mark.gpu)


def assert_ulps_close(ours, expected, n=2):
    """The same math rounded the same way: ``n`` units in the last place at the result's largest magnitude
    (one more bf16 ulp under the interpreter, which truncates fp32 -> bf16)."""
    ulp = torch.finfo(ours.dtype).eps * (n + (ours.dtype == torch.bfloat16 and interpreter_active()))
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(ours, expected, rtol=ulp, atol=ulp * scale)


def assert_rule(ours, torch_same_dtype, oracle, what=""):
    """``assert_accurate``, with the bound doubled for bf16 under the interpreter (which truncates to bf16)."""
    if not (ours.dtype == torch.bfloat16 and interpreter_active()):
        return assert_accurate(ours, torch_same_dtype, oracle, what=what)
    report = error_report(ours, torch_same_dtype, oracle, factor=4.0)
    scale = float(oracle.double().abs().max()) if oracle.numel() else 0.0
    allowed = max(report.allowed, 2 * torch.finfo(ours.dtype).eps * scale)
    assert ours.dtype == torch_same_dtype.dtype and report.ours <= allowed, (
        f"{what}: max error {report.ours:.3g} over the interpreter's bf16 bound {allowed:.3g} "
        f"(PyTorch's same-dtype error {report.torch:.3g})")


# ---- oracles: the formulas a plain PyTorch model runs -------------------------------------------------


def hf_rms_norm(x, weight, eps):
    """LlamaRMSNorm.forward; in fp32 (fp64 for an fp64 x), rounded to x's dtype before the weight."""
    h = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(x.dtype)


def rms_oracle(x, weight, eps):
    ref = reference_dtype(x.dtype)
    return hf_rms_norm(x.to(ref), weight.to(ref), eps)


def torch_gelu_and_mul(x, approximate):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def hf_rotary(positions, t, cache, is_neox, dtype):
    """HF's apply_rotary_pos_emb (NeoX: rotate_half; GPT-J: rotate_every_two) with partial rotary, cos and sin
    in ``dtype``; returns the rotated copy of ``t`` in ``dtype``."""
    rot = cache.shape[-1]
    cos, sin = cache[positions].chunk(2, dim=-1)
    if is_neox:
        cos, sin, rotate = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), rotate_half
    else:
        cos, sin, rotate = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), rotate_every_two
    cos, sin = cos[:, None].to(dtype), sin[:, None].to(dtype)
    t = t.to(dtype)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    return torch.cat((t_rot * cos + rotate(t_rot) * sin, t_pass), dim=-1)


def llama3_inv_freq_one_by_one(dim, base, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's frequency scaling (transformers' rope_type "llama3"), one frequency at a time from HF's
    fp32 frequencies: wavelengths shorter than old_context_len / high_freq_factor are kept, longer than
    old_context_len / low_freq_factor divided by factor, and those between interpolated."""
    scaled = []
    for freq in (1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high_freq_factor:
            scaled.append(freq)
        elif wavelen > old_context_len / low_freq_factor:
            scaled.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(scaled, dtype=torch.float64)


def llm_like(shape, dtype, device, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype).to(device)


def norm_weight(hidden, dtype, device):
    return (1 + 0.1 * torch.randn(hidden)).to(dtype).to(device)  # trained norm weights sit near 1


# ---- RMSNorm kernels ------------------------------------------------------------------------------------

RMS_SHAPES = [(1, 1), (3, 8), (5, 37), (2, 3, 1000), (4, 4096), (0, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rms_norm_kernel(kdevice, dtype, shape):
    from anygpu.kernels.rms_norm import rms_norm as kernel

    x = llm_like(shape, dtype, kdevice, scale=3)
    w = norm_weight(shape[-1], dtype, kdevice)
    out = poison_(torch.empty(shape, dtype=dtype, device=kdevice))
    y = kernel(x, w, 1e-6, out=out)
    assert y is out and not torch.isnan(y).any()
    assert_rule(y, hf_rms_norm(x, w, 1e-6), rms_oracle(x, w, 1e-6), what=f"{dtype} {shape}")
    assert_ulps_close(y, rms_reference(x, w, 1e-6))


@pytest.mark.parametrize("hidden", [8192, 16384])
def test_rms_norm_kernel_widest_rows(kdevice, hidden):
    from anygpu.kernels.rms_norm import fused_add_rms_norm as fused_kernel
    from anygpu.kernels.rms_norm import rms_norm as kernel

    x, r = llm_like((2, hidden), torch.bfloat16, kdevice), llm_like((2, hidden), torch.bfloat16, kdevice)
    w = norm_weight(hidden, torch.bfloat16, kdevice)
    assert_rule(kernel(x, w, 1e-5), hf_rms_norm(x, w, 1e-5), rms_oracle(x, w, 1e-5))
    normed, new_residual = fused_kernel(x, r, w, 1e-5)
    s = x + r
    assert_rule(normed, hf_rms_norm(s, w, 1e-5), rms_oracle(s, w, 1e-5))


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                             (torch.float32, torch.bfloat16)])
def test_rms_norm_kernel_weight_in_another_dtype(kdevice, x_dtype, w_dtype):
    """The output keeps x's dtype: HF's value (promoted to the wider dtype) rounded to x's."""
    from anygpu.kernels.rms_norm import rms_norm as kernel

    x, w = llm_like((6, 300), x_dtype, kdevice, scale=2), norm_weight(300, w_dtype, kdevice)
    y = kernel(x, w, 1e-6)
    assert y.dtype == x_dtype
    assert_rule(y, hf_rms_norm(x, w, 1e-6), rms_oracle(x, w, 1e-6))
    assert_ulps_close(y, rms_reference(x, w, 1e-6))


def test_rms_norm_kernel_non_contiguous_and_in_place(kdevice):
    from anygpu.kernels.rms_norm import rms_norm as kernel

    w = norm_weight(40, torch.float32, kdevice)
    for x in (torch.randn(9, 40, device=kdevice)[::2],  # row stride of 2 rows
              torch.randn(40, 7, device=kdevice).t(),  # unit stride on the rows, not the columns
              torch.randn(3, 40, 5, device=kdevice).transpose(1, 2)):  # 3-d, no view as [rows, 40]
        torch.testing.assert_close(kernel(x, w, 1e-6), rms_reference(x, w, 1e-6))
    w2 = norm_weight(80, torch.float32, kdevice)[::2]  # a strided weight
    x = torch.randn(4, 40, device=kdevice)
    torch.testing.assert_close(kernel(x, w2, 1e-6), rms_reference(x, w2, 1e-6))
    expected = rms_reference(x, w, 1e-6)
    assert kernel(x, w, 1e-6, out=x) is x  # in place: each program reads its row before writing it
    torch.testing.assert_close(x, expected)


def test_rms_norm_kernel_rejects_bad_out(kdevice):
    from anygpu.kernels.rms_norm import fused_add_rms_norm as fused_kernel
    from anygpu.kernels.rms_norm import rms_norm as kernel

    x, w = torch.randn(4, 16, device=kdevice), torch.ones(16, device=kdevice)
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float32 tensor of shape"):
        kernel(x, w, 1e-6, out=torch.empty(4, 9, device=kdevice))
    with pytest.raises(ValueError, match="residual_out: expected a contiguous"):
        fused_kernel(x, x, w, 1e-6, residual_out=torch.empty(4, 16, dtype=torch.float16, device=kdevice))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 37), (2, 3, 1000), (0, 64)])
def test_fused_add_rms_norm_kernel(kdevice, dtype, shape):
    from anygpu.kernels.rms_norm import fused_add_rms_norm as kernel

    x, r = llm_like(shape, dtype, kdevice, scale=2), llm_like(shape, dtype, kdevice, scale=4)
    w = norm_weight(shape[-1], dtype, kdevice)
    out, res_out = (poison_(torch.empty(shape, dtype=dtype, device=kdevice)) for _ in range(2))
    normed, new_residual = kernel(x, r, w, 1e-6, out=out, residual_out=res_out)
    assert normed is out and new_residual is res_out
    s = x + r  # what the unfused model stores, rounded to the dtype
    if dtype == torch.bfloat16 and interpreter_active():
        assert_ulps_close(new_residual, s, 0)
    else:
        assert torch.equal(new_residual, s)  # bit-exact: the same sum, rounded to nearest once
    assert_rule(normed, hf_rms_norm(s, w, 1e-6), rms_oracle(s, w, 1e-6), what=f"{dtype} {shape}")
    ref_normed, _ = fused_reference(x, r, w, 1e-6)
    assert_ulps_close(normed, ref_normed)


def test_fused_add_rms_norm_kernel_in_place_and_strided(kdevice):
    """vLLM's in-place use: the residual buffer takes the new residual and x the normed output."""
    from anygpu.kernels.rms_norm import fused_add_rms_norm as kernel

    x, r, w = torch.randn(6, 96, device=kdevice), torch.randn(6, 96, device=kdevice), norm_weight(96, torch.float32,
                                                                                                    kdevice)
    expected = fused_reference(x, r, w, 1e-6)
    assert kernel(x, r, w, 1e-6, out=x, residual_out=r) == (x, r)
    torch.testing.assert_close((x, r), expected)
    xs, rs = torch.randn(12, 96, device=kdevice)[::2], torch.randn(96, 6, device=kdevice).t()
    torch.testing.assert_close(kernel(xs, rs, w, 1e-6), fused_reference(xs, rs, w, 1e-6))


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(0, 5), hidden=st.integers(1, 3000), dtype=st.sampled_from(DTYPES),
       scale=st.floats(0.01, 100.0), fused=st.booleans())
def test_rms_norm_kernels_any_shape(rows, hidden, dtype, scale, fused):
    dev = kernel_device()
    if dev is None:
        pytest.skip("Triton kernels cannot run here")
    from anygpu.kernels.rms_norm import fused_add_rms_norm as fused_kernel
    from anygpu.kernels.rms_norm import rms_norm as kernel

    x, w = llm_like((rows, hidden), dtype, dev, scale), norm_weight(hidden, dtype, dev)
    if fused:
        r = llm_like((rows, hidden), dtype, dev, scale)
        y, x = fused_kernel(x, r, w, 1e-5)[0], x + r
    else:
        y = kernel(x, w, 1e-5)
    assert_rule(y, hf_rms_norm(x, w, 1e-5), rms_oracle(x, w, 1e-5), what=f"{dtype} {rows}x{hidden}")


# ---- GELU-and-mul kernel --------------------------------------------------------------------------------


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 2 * 37), (4, 2 * 1024), (2, 3, 2 * 2500), (0, 8)])
def test_gelu_and_mul_kernel(kdevice, dtype, shape, approximate):
    from anygpu.kernels.gelu_and_mul import gelu_and_mul as kernel

    x = llm_like(shape, dtype, kdevice, scale=4)
    out = poison_(torch.empty(*shape[:-1], shape[-1] // 2, dtype=dtype, device=kdevice))
    y = kernel(x, approximate, out=out)
    assert y is out and not torch.isnan(y).any()
    oracle = torch_gelu_and_mul(x.to(reference_dtype(dtype)), approximate)
    assert_rule(y, torch_gelu_and_mul(x, approximate), oracle, what=f"{dtype} {shape} {approximate}")
    assert_ulps_close(y, gelu_reference(x, approximate))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_kernel_tails_and_non_contiguous(kdevice, approximate):
    """Far tails (gelu -> 0 and -> x, where a tanh via exp could overflow or cancel), and strided x."""
    from anygpu.kernels.gelu_and_mul import gelu_and_mul as kernel

    gate = torch.tensor([-1e4, -200.0, -30.0, -10.0, -1e-3, 0.0, 1e-20, 1e-3, 3.0, 30.0, 1e4])
    x = torch.cat([gate, torch.full_like(gate, 1.5)]).to(kdevice)
    y = kernel(x, approximate)
    torch.testing.assert_close(y, torch_gelu_and_mul(x.double(), approximate).float(), rtol=2e-6, atol=1e-30)
    x = torch.randn(2 * 40, 7, device=kdevice).t()  # last dim stride != 1
    torch.testing.assert_close(kernel(x, approximate), gelu_reference(x, approximate))
    x = torch.randn(9, 2 * 40, device=kdevice)[::2]
    torch.testing.assert_close(kernel(x, approximate), gelu_reference(x, approximate))
    with pytest.raises(ValueError, match="approximate: expected 'none' or 'tanh', got 'fast'"):
        kernel(x, "fast")


# ---- rotary embedding kernel ----------------------------------------------------------------------------


def qkv_views(tokens, q_heads, kv_heads, head_dim, dtype, device, scale=2.0):
    """q and k as views of one fused QKV projection output [T, (Hq + 2 Hkv) * D], as in a model."""
    qkv = llm_like((tokens, (q_heads + 2 * kv_heads) * head_dim), dtype, device, scale)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rot_dim", [((4, 2), 64, 64), ((5, 1), 80, 80), ((3, 3), 128, 32),
                                                    ((33, 1), 16, 16)])
def test_rotary_kernel(kdevice, dtype, is_neox, heads, head_dim, rot_dim):
    from anygpu.kernels.rotary_embedding import rotary_embedding as kernel

    tokens, max_position = 7, 300
    qkv, q, k = qkv_views(tokens, *heads, head_dim, dtype, kdevice)
    before = qkv.clone()
    cache = rotary_cos_sin_cache(rot_dim, max_position, device=kdevice)
    positions = torch.randint(0, max_position, (tokens,), device=kdevice)
    positions[0] = max_position - 1
    kernel(positions, q, k, cache, is_neox)
    q_end, k_end = q.shape[1] * head_dim, (q.shape[1] + k.shape[1]) * head_dim
    for name, ours, t in (("query", q, before[:, :q_end].view_as(q)), ("key", k, before[:, q_end:k_end].view_as(k))):
        oracle = hf_rotary(positions, t, cache, is_neox, reference_dtype(dtype))
        assert_rule(ours, hf_rotary(positions, t, cache, is_neox, dtype), oracle,
                    what=f"{name} {dtype} neox={is_neox} {heads} {head_dim}/{rot_dim}")
        assert torch.equal(ours[..., rot_dim:], t[..., rot_dim:])  # partial rotary: the rest untouched
        expected = t.clone()
        rotary_reference(positions, expected, expected.clone(), cache, is_neox)
        assert_ulps_close(ours, expected)
    assert torch.equal(qkv[:, k_end:], before[:, k_end:])  # V, next to K in the fused buffer, untouched


def test_rotary_kernel_decode_and_empty(kdevice):
    from anygpu.kernels.rotary_embedding import rotary_embedding as kernel

    cache = rotary_cos_sin_cache(128, 64, base=500000.0, device=kdevice)
    _, q, k = qkv_views(1, 32, 8, 128, torch.bfloat16, kdevice)  # Llama-3-8B, one decode token
    q0, k0 = q.clone(), k.clone()
    positions = torch.tensor([63], device=kdevice)
    kernel(positions, q, k, cache, True)
    q_ref, k_ref = q0.clone(), k0.clone()
    rotary_reference(positions, q_ref, k_ref, cache, True)
    assert_ulps_close(q, q_ref)
    assert_ulps_close(k, k_ref)
    empty = torch.empty(0, 4, 64, device=kdevice)
    kernel(torch.empty(0, dtype=torch.int64, device=kdevice), empty, empty[:, :2], cache[:, :64], False)


def test_rotary_kernel_position_zero_is_identity_and_rotation_keeps_norms(kdevice):
    from anygpu.kernels.rotary_embedding import rotary_embedding as kernel

    cache = rotary_cos_sin_cache(64, 1000, device=kdevice)
    q, k = torch.randn(3, 4, 64, device=kdevice), torch.randn(3, 2, 64, device=kdevice)
    q0, k0 = q.clone(), k.clone()
    kernel(torch.zeros(3, dtype=torch.int64, device=kdevice), q, k, cache, True)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    kernel(torch.tensor([1, 500, 999], device=kdevice), q, k, cache, False)
    torch.testing.assert_close(q.norm(dim=-1), q0.norm(dim=-1))


# ---- the cos/sin cache ----------------------------------------------------------------------------------


def test_cos_sin_cache_matches_hf_default_and_scalings():
    rot, n = 128, 2048
    cache = rotary_cos_sin_cache(rot, n, base=500000.0)
    assert cache.shape == (n, rot) and cache.dtype == torch.float32
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    # HF's fp32 frequencies put its angles up to ~position * 2^-24 radians off ours (exact, then rounded).
    torch.testing.assert_close(cache, torch.cat([angles.cos(), angles.sin()], -1).float(), rtol=0, atol=n * 2**-22)

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    ours = rotary_cos_sin_cache(rot, n, base=500000.0, scaling=llama3, dtype=torch.float64)
    hf_freq = llama3_inv_freq_one_by_one(rot, 500000.0, 8.0, 1.0, 4.0, 8192)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * hf_freq[None, :]
    torch.testing.assert_close(ours, torch.cat([angles.cos(), angles.sin()], -1), rtol=0, atol=n * 2**-22)
    # The three bands are all there: kept (high frequencies), divided by 8 (low) and interpolated.
    freq = torch.atan2(ours[1, rot // 2:], ours[1, : rot // 2])
    plain = rotary_cos_sin_cache(rot, 2, base=500000.0, dtype=torch.float64)
    plain_freq = torch.atan2(plain[1, rot // 2:], plain[1, : rot // 2])
    ratio = plain_freq / freq
    assert ratio[0] == pytest.approx(1) and ratio[-1] == pytest.approx(8)
    assert ((ratio > 1.01) & (ratio < 7.99)).any()

    legacy = dict(llama3, type="llama3")
    del legacy["rope_type"]  # older configs name it "type"
    assert torch.equal(rotary_cos_sin_cache(rot, 16, base=500000.0, scaling=legacy),
                       rotary_cos_sin_cache(rot, 16, base=500000.0, scaling=llama3))
    linear = rotary_cos_sin_cache(64, 64, scaling={"rope_type": "linear", "factor": 4.0}, dtype=torch.float64)
    plain = rotary_cos_sin_cache(64, 16, dtype=torch.float64)
    torch.testing.assert_close(linear[::4], plain)  # position 4p, scaled, is position p unscaled
    assert torch.equal(rotary_cos_sin_cache(64, 8, scaling={"rope_type": "default"}), rotary_cos_sin_cache(64, 8))


def test_cos_sin_cache_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="rot_dim: expected a positive even int, got 63"):
        rotary_cos_sin_cache(63, 10)
    with pytest.raises(ValueError, match="max_position: expected a positive int"):
        rotary_cos_sin_cache(64, 0)
    with pytest.raises(ValueError, match="base: expected a number > 1"):
        rotary_cos_sin_cache(64, 10, base=1.0)
    with pytest.raises(ValueError, match="scaling: expected rope_type 'default', 'linear' or 'llama3', got 'yarn'"):
        rotary_cos_sin_cache(64, 10, scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="scaling: rope_type 'llama3' needs the key 'low_freq_factor'"):
        rotary_cos_sin_cache(64, 10, scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="scaling: expected a dict"):
        rotary_cos_sin_cache(64, 10, scaling=8.0)


# ---- the ops --------------------------------------------------------------------------------------------


def rotary_args(device, dtype=torch.float32, tokens=5):
    _, q, k = qkv_views(tokens, 4, 2, 32, dtype, device)
    cache = rotary_cos_sin_cache(16, 50, device=device)
    return torch.randint(0, 50, (tokens,), device=device), q, k, cache


def op_cases(device, dtype):
    """(op, args) for opcheck and the fake-tensor tests."""
    x = torch.randn(3, 5, 48, device=device, dtype=dtype)
    w = norm_weight(48, dtype, device)
    return [(rms_norm, (x, w, 1e-6)), (fused_add_rms_norm, (x, torch.randn_like(x), w, 1e-6)),
            (gelu_and_mul, (x, "none")), (gelu_and_mul, (x, "tanh")),
            (rotary_embedding, (*rotary_args(device, dtype), True)), (rotary_embedding, (*rotary_args(device, dtype), False))]


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    for op, args in op_cases(device, dtype):
        torch.library.opcheck(op.overload, args)
    x = torch.randn(3, 48, device=device, dtype=dtype, requires_grad=True)  # with autograd registered
    torch.library.opcheck(rms_norm.overload, (x, norm_weight(48, dtype, device).requires_grad_(), 1e-6))
    torch.library.opcheck(gelu_and_mul.overload, (x, "tanh"))


def test_registered_and_exported():
    from anygpu.ops import ALL_OPS

    for op in (rms_norm, fused_add_rms_norm, gelu_and_mul, rotary_embedding):
        assert ALL_OPS[op.name] is op and getattr(torch.ops.anygpu, op.name).default is op.overload
    assert rms_norm.gpu_kernel == "rms_norm:rms_norm" and fused_add_rms_norm.gpu_kernel == "rms_norm:fused_add_rms_norm"


def test_meta_shapes_and_compile():
    meta = torch.device("meta")
    x = torch.empty(2, 7, 4096, device=meta, dtype=torch.bfloat16)
    w = torch.empty(4096, device=meta, dtype=torch.float32)
    assert rms_norm(x, w, 1e-5).shape == x.shape and rms_norm(x, w, 1e-5).dtype == torch.bfloat16
    normed, res = fused_add_rms_norm(x, x, w, 1e-5)
    assert normed.shape == res.shape == x.shape
    assert gelu_and_mul(x, "tanh").shape == (2, 7, 2048)
    positions, q, k, cache = rotary_args(meta)
    assert rotary_embedding(positions, q, k, cache, True) is None

    def block(x, residual, weight, positions, q, k, cache):
        normed, residual = fused_add_rms_norm(x, residual, weight, 1e-5)
        rotary_embedding(positions, q, k, cache, True)
        return rms_norm(normed, weight, 1e-5) + gelu_and_mul(torch.cat([normed, normed], -1), "tanh"), q * 1, k * 1

    x, r, w = torch.randn(4, 32), torch.randn(4, 32), norm_weight(32, torch.float32, "cpu")
    positions, q, k, cache = rotary_args("cpu", tokens=4)
    eager = block(x, r, w, positions, q.clone(), k.clone(), cache)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, r, w, positions, q.clone(), k.clone(),
                                                                          cache)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("dtype", DTYPES)
def test_references_within_the_rule(dtype):
    x, r = llm_like((7, 300), dtype, "cpu", 3), llm_like((7, 300), dtype, "cpu", 3)
    w = norm_weight(300, dtype, "cpu")
    assert_accurate(rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6), rms_oracle(x, w, 1e-6))
    normed, new_residual = fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_residual, x + r)
    assert_accurate(normed, hf_rms_norm(x + r, w, 1e-6), rms_oracle(x + r, w, 1e-6))
    x2 = llm_like((7, 2 * 300), dtype, "cpu", 4)
    for approximate in ("none", "tanh"):
        oracle = torch_gelu_and_mul(x2.to(reference_dtype(dtype)), approximate)
        assert_accurate(gelu_and_mul(x2, approximate), torch_gelu_and_mul(x2, approximate), oracle)
    positions, q, k, cache = rotary_args("cpu", dtype)
    q0 = q.clone()
    rotary_embedding(positions, q, k, cache, True)
    assert_accurate(q, hf_rotary(positions, q0, cache, True, dtype),
                    hf_rotary(positions, q0, cache, True, reference_dtype(dtype)))


@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_cpu_implementation_within_the_rule(shape, w_dtype):
    """What the CPU runs for fp32 x (PyTorch's own RMSNorm with an fp32 weight, else the reference) against the
    fp64 oracle, fused with the residual add or not."""
    from anygpu.ops.fused_add_rms_norm import cpu as fused_cpu
    from anygpu.ops.rms_norm import cpu as rms_cpu

    x, r = llm_like(shape, torch.float32, "cpu", 3), llm_like(shape, torch.float32, "cpu", 3)
    w = norm_weight(shape[-1], w_dtype, "cpu")
    assert_accurate(rms_cpu(x, w, 1e-6), hf_rms_norm(x, w.float(), 1e-6), rms_oracle(x, w, 1e-6))
    normed, new_residual = fused_cpu(x, r, w, 1e-6)
    assert torch.equal(new_residual, x + r)
    assert_accurate(normed, hf_rms_norm(x + r, w.float(), 1e-6), rms_oracle(x + r, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 3072), (2, 5, 18), (0, 8)])
def test_silu_and_mul_cpu_implementation_equals_the_reference(dtype, shape):
    from anygpu.ops.silu_and_mul import cpu, reference

    x = llm_like(shape, dtype, "cpu", 3)
    x0 = x.clone()
    out, want = cpu(x), reference(x)
    as_int = torch.int32 if dtype == torch.float32 else torch.int16
    assert out.dtype == dtype and torch.equal(out.view(as_int), want.view(as_int))  # bit for bit
    assert torch.equal(x, x0)  # the input is left alone


def test_bad_arguments_name_the_argument():
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\) \(x's last dimension\), got \(7,\)"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
        rms_norm(x, torch.ones(1, 8), 1e-6)
    with pytest.raises(ValueError, match="weight: expected dtype float16, bfloat16 or float32, got torch.float64"):
        rms_norm(x, w.double(), 1e-6)
    with pytest.raises(ValueError, match="x: expected dtype float16, bfloat16 or float32, got torch.int32"):
        rms_norm(x.int(), w, 1e-6)
    with pytest.raises(ValueError, match=r"x: expected a tensor \[\.\.\., hidden\] with hidden <= 16384"):
        rms_norm(torch.empty(1, 16385), torch.empty(16385), 1e-6)
    with pytest.raises(ValueError, match=r"x: expected a tensor \[\.\.\., hidden\]"):
        rms_norm(torch.tensor(1.0), w, 1e-6)
    for eps in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
            rms_norm(x, w, eps)
    with pytest.raises(ValueError, match=r"residual: expected a torch.float32 tensor of x's shape \(3, 8\)"):
        fused_add_rms_norm(x, torch.randn(3, 9), w, 1e-6)
    with pytest.raises(ValueError, match="residual: expected a torch.float32 tensor"):
        fused_add_rms_norm(x, x.half(), w, 1e-6)
    with pytest.raises(ValueError, match="weight: expected shape"):
        fused_add_rms_norm(x, x, torch.ones(4), 1e-6)

    with pytest.raises(ValueError, match="approximate: expected 'none' or 'tanh', got 'sigmoid'"):
        gelu_and_mul(torch.randn(3, 8), "sigmoid")
    with pytest.raises(ValueError, match=r"x: expected a last dimension of even size 2\*d, got shape \(3, 7\)"):
        gelu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="x: expected dtype float16, bfloat16 or float32, got torch.float64"):
        gelu_and_mul(torch.randn(3, 8, dtype=torch.float64))

    positions, q, k, cache = rotary_args("cpu")
    with pytest.raises(ValueError, match=r"positions: expected an int64 tensor \[5\]"):
        rotary_embedding(positions.int(), q, k, cache, True)
    with pytest.raises(ValueError, match=r"positions: expected an int64 tensor \[5\]"):
        rotary_embedding(positions[:4], q, k, cache, True)
    with pytest.raises(ValueError, match=r"query: expected a float16, bfloat16 or float32 tensor \[tokens, heads"):
        rotary_embedding(positions, q.reshape(5, -1), k, cache, True)
    with pytest.raises(ValueError, match="query: expected .* unit stride on head_dim"):
        rotary_embedding(positions, q.transpose(1, 2), k, cache, True)
    with pytest.raises(ValueError, match=r"key: expected a torch.float32 tensor \[5, kv_heads, 32\]"):
        rotary_embedding(positions, q, k.half(), cache, True)
    with pytest.raises(ValueError, match=r"key: expected a torch.float32 tensor \[5, kv_heads, 32\]"):
        rotary_embedding(positions, q, k[..., :16], cache, True)
    with pytest.raises(ValueError, match="cos_sin_cache: expected a float32 tensor .* <= head_dim 32"):
        rotary_embedding(positions, q, k, rotary_cos_sin_cache(64, 50), True)
    with pytest.raises(ValueError, match="cos_sin_cache: expected a float32 tensor"):
        rotary_embedding(positions, q, k, cache.half(), True)
    with pytest.raises(ValueError, match="cos_sin_cache: expected a float32 tensor"):
        rotary_embedding(positions, q, k, cache[:, :15], True)


def test_rotary_positions_out_of_range_raise_in_the_reference():
    """Documented: the CPU reference raises; the GPU kernel does not check (it would need a sync)."""
    positions, q, k, cache = rotary_args("cpu")
    positions[2] = cache.shape[0]
    with pytest.raises(IndexError):
        rotary_embedding(positions, q, k, cache, True)


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_rms_norm_backward_matches_autograd_of_the_math(device):
    x = torch.randn(2, 6, 33, device=device, requires_grad=True)
    w = norm_weight(33, torch.float32, device).requires_grad_()
    g = torch.randn(2, 6, 33, device=device)
    rms_norm(x, w, 1e-5).backward(g)
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    hf_rms_norm(x2, w2, 1e-5).backward(g.double())
    torch.testing.assert_close((x.grad.double(), w.grad.double()), (x2.grad, w2.grad), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_backward_matches_autograd_of_the_math(device, approximate):
    x = torch.randn(6, 2 * 33, device=device, requires_grad=True) * 3
    x.retain_grad()
    g = torch.randn(6, 33, device=device)
    gelu_and_mul(x, approximate).backward(g)
    x2 = x.detach().double().requires_grad_()
    torch_gelu_and_mul(x2, approximate).backward(g.double())
    torch.testing.assert_close(x.grad.double(), x2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dispatch_runs_the_triton_kernels(dtype, monkeypatch):
    from anygpu.kernels.gelu_and_mul import gelu_and_mul as gelu_kernel
    from anygpu.kernels.rms_norm import fused_add_rms_norm as fused_kernel
    from anygpu.kernels.rms_norm import rms_norm as rms_kernel
    from anygpu.kernels.rotary_embedding import rotary_embedding as rotary_kernel

    x, r = torch.randn(33, 4096, device="cuda", dtype=dtype), torch.randn(33, 4096, device="cuda", dtype=dtype)
    w = norm_weight(4096, dtype, "cuda")
    assert torch.equal(rms_norm(x, w, 1e-5), rms_kernel(x, w, 1e-5))
    assert all(map(torch.equal, fused_add_rms_norm(x, r, w, 1e-5), fused_kernel(x, r, w, 1e-5)))
    assert torch.equal(gelu_and_mul(x, "tanh"), gelu_kernel(x, "tanh"))
    positions, q, k, cache = rotary_args("cuda", dtype, tokens=33)
    q2, k2 = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, True)
    rotary_kernel(positions, q2, k2, cache, True)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    monkeypatch.setenv("ANYGPU_KERNELS", "reference")
    assert_accurate(rms_norm(x, w, 1e-5), hf_rms_norm(x, w, 1e-5), rms_oracle(x, w, 1e-5))


def test_kernel_and_op_agree_on_the_widest_row():
    from anygpu.ops.rms_norm import MAX_HIDDEN

    kernels = pytest.importorskip("anygpu.kernels.rms_norm")
    assert kernels.MAX_HIDDEN == MAX_HIDDEN == max(c.constexprs["BLOCK"] for c in kernels.CONFIGS["default"])


# ---- the bench suite builds a case per op, and its baselines compute what ours does ---------------------


def test_elementwise_suite_cases_agree_with_their_torch_baselines():
    from anygpu.bench import load_suites

    cases = load_suites()["elementwise"](torch.device("cpu"), quick=False)
    assert {c.op for c in cases} == {"silu_and_mul", "rms_norm", "fused_add_rms_norm", "gelu_and_mul",
                                     "rotary_embedding"}
    assert all(c.bytes and set(c.baselines) == {"torch", "copy"} for c in cases)
    for case in cases:
        expected = case.baselines["torch"]()  # first: ours rotates q and k in place, the baseline does not
        torch.testing.assert_close(case.ours(), expected, rtol=1e-5, atol=1e-5, msg=f"{case.op} {case.shape}")
