"""GGUF's 4-bit types in the 4-bit matmul's layout (``anygpu.quant.gguf_4bit``): ``code[q] * absmax + offset``
equals ``gguf.quants.dequantize`` for Q4_0, Q4_1 (real blocks from ``gguf.quants.quantize``), Q4_K, IQ4_NL and
IQ4_XS (random valid blocks: gguf-py has no quantizer for them): bit for bit, but for the one fp32 rounding of
Q4_1 / Q4_K's centred offset (the module doc says why); fused rows; the torch quantizers."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from anygpu.ops.matmul_4bit import dequantize_weight  # noqa: E402
from anygpu.quant import gguf_4bit  # noqa: E402
from anygpu.quant.gguf_blocks import BLOCK_SHAPES  # noqa: E402

N, K = 6, 512


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Valid blocks: real ones where gguf-py quantizes the type, else random bytes with sane fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q4_0", "Q4_1"):
        w = torch.randn(n, k, generator=g).numpy()
        return torch.from_numpy(gguf.quants.quantize(w, qtype).copy()).reshape(-1)
    block, size = BLOCK_SHAPES[type_name]
    raw = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, generator=g)
    scales = (torch.rand(raw.shape[0], 2, generator=g) * 0.02 + 1e-4).half().view(torch.uint8)
    raw[:, :4] = scales  # d (and Q4_K's dmin; IQ4_XS's scales_h is random either way: bytes 2..3 are its bits)
    if type_name == "IQ4_XS":
        raw[:, 2:4] = torch.randint(0, 256, (raw.shape[0], 2), dtype=torch.uint8, generator=g)
    return raw.reshape(-1)


def oracle(raw: torch.Tensor, type_name: str, n: int, k: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, k)


def values(p: gguf_4bit.Packed4bit, n: int, k: int) -> torch.Tensor:
    return dequantize_weight(p.packed, p.absmax, p.code, 32, n, k, torch.float32, offset=p.offset)


def assert_values(p: gguf_4bit.Packed4bit, n: int, k: int, want: torch.Tensor) -> None:
    """Exact without an offset; with one, off by at most the offset's one rounding (half an ulp of it) plus the
    final rounding's (an ulp of the value): code * absmax + offset is the exact GGUF sum but for that."""
    got = values(p, n, k)
    if p.absmax.dtype == torch.float16:
        # each value within 2^-11 of its block's |scale| + |offset| (codes are at most 1 in magnitude)
        scale = p.absmax.float().abs().repeat_interleave(32).reshape(n, k)
        off = 0 if p.offset is None else p.offset.float().abs().repeat_interleave(32).reshape(n, k)
        assert ((got - want).abs() <= 2.0 ** -11 * (scale + off) * 1.001 + 2.0 ** -23 * want.abs()).all()
        return
    if p.offset is None:
        assert torch.equal(got, want)
        return
    off = p.offset.abs().repeat_interleave(32).reshape(n, k)
    assert ((got - want).abs() <= 2.0 ** -24 * off + 2.0 ** -23 * want.abs()).all()
    assert (got == want).float().mean() > 0.9  # mostly the very same values


@pytest.mark.parametrize("type_name", gguf_4bit.TYPES)
def test_convert_equals_gguf_dequantize_exactly(type_name):
    raw = random_blocks(type_name, N, K)
    p = gguf_4bit.convert(raw, type_name, N, K)
    assert p.packed.dtype == torch.uint8 and p.packed.shape == (N * K // 2,)
    assert p.absmax.shape == (N * K // 32,) and p.absmax.dtype == torch.float32
    assert (p.offset is not None) == (type_name in ("Q4_1", "Q4_K"))
    assert p.code.abs().max() <= 1  # bitsandbytes-sized codes: 16-bit products keep NF4's headroom
    assert_values(p, N, K, oracle(raw, type_name, N, K))
    h = gguf_4bit.convert(raw, type_name, N, K, half_scales=True)  # for 16-bit layers: fp16 where it fits
    assert h.absmax.dtype == torch.float16 and torch.equal(h.packed, p.packed)
    assert_values(h, N, K, oracle(raw, type_name, N, K))
    if type_name in ("Q4_0", "IQ4_NL"):  # fp16 d times a power of two: exact in fp16 too
        assert torch.equal(values(h, N, K), oracle(raw, type_name, N, K))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K"])
def test_scales_out_of_fp16_range_stay_fp32_and_exact(type_name):
    """A tensor with one scale past fp16's range (8 d > 65504) keeps all its scales and offsets in fp32."""
    raw = random_blocks(type_name, N, K).reshape(N * K // BLOCK_SHAPES[type_name][0], -1)
    raw[0, :2] = torch.tensor([16384.0], dtype=torch.float16).view(torch.uint8)
    raw = raw.reshape(-1)
    p = gguf_4bit.convert(raw, type_name, N, K, half_scales=True)
    assert p.absmax.dtype == torch.float32 and (p.offset is None or p.offset.dtype == torch.float32)
    assert_values(p, N, K, oracle(raw, type_name, N, K))


def test_small_offsets_next_to_larger_scales_still_narrow():
    """Q4_K offsets (8 d sc - dmin m) of random weights often lie near zero, below fp16's normal range: they stay
    fp16 while their rounding is small against their block's scale."""
    raw = gguf_4bit.quantize_q4_k(torch.randn(64, 512) * 0.02).reshape(-1)
    p = gguf_4bit.convert(raw, "Q4_K", 64, 512, half_scales=True)
    e = gguf_4bit._groups(raw, "Q4_K")[2].abs()
    assert bool(((e > 0) & (e < 2.0 ** -14)).any())  # some subnormal in fp16
    assert p.absmax.dtype == p.offset.dtype == torch.float16
    assert_values(p, 64, 512, oracle(raw, "Q4_K", 64, 512))


def test_stack_of_fp16_and_fp32_parts_is_fp32():
    big = random_blocks("Q4_0", 2, 256, seed=1).reshape(16, 18)
    big[0, :2] = torch.tensor([16384.0], dtype=torch.float16).view(torch.uint8)
    raws = [random_blocks("Q4_K", 3, 256), big.reshape(-1)]
    parts = [gguf_4bit.convert(raws[0], "Q4_K", 3, 256, half_scales=True),
             gguf_4bit.convert(raws[1], "Q4_0", 2, 256, half_scales=True)]
    assert [p.absmax.dtype for p in parts] == [torch.float16, torch.float32]
    p = gguf_4bit.stack(parts)
    assert p.absmax.dtype == p.offset.dtype == torch.float32
    assert torch.equal(values(p, 5, 256), torch.cat([values(parts[0], 3, 256), values(parts[1], 2, 256)]))


def test_nibble_order_is_bitsandbytes():
    """Element 2i in the high nibble, 2i + 1 in the low one, whatever GGUF's order."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 17] = -8.0, 7.0, 3.0  # d = 1: q = x + 8
    raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0).copy()).reshape(-1)
    p = gguf_4bit.convert(raw, "Q4_0", 1, 32)
    assert p.packed[0] == (0 << 4 | 15) and p.packed[8] == (8 << 4 | 11)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q4_0"), ("Q4_0", "Q4_1"), ("IQ4_NL", "IQ4_XS"),
                                   ("Q4_0", "Q4_0")])
def test_stacked_rows_equal_each_source(types):
    rows = (4, 2, 3)[:len(types)]
    raws = [random_blocks(t, r, 256, seed=i) for i, (t, r) in enumerate(zip(types, rows))]
    assert gguf_4bit.stackable(types)
    p = gguf_4bit.stack([gguf_4bit.convert(raw, t, r, 256) for raw, t, r in zip(raws, types, rows)])
    want = torch.cat([oracle(raw, t, r, 256) for raw, t, r in zip(raws, types, rows)])
    assert_values(p, sum(rows), 256, want)


def test_iq4_does_not_stack_with_others():
    assert not gguf_4bit.stackable(("IQ4_NL", "Q4_0")) and not gguf_4bit.stackable(("Q4_K", "Q6_K"))
    parts = [gguf_4bit.convert(random_blocks(t, 1, 32), t, 1, 32) for t in ("IQ4_NL", "Q4_0")]
    with pytest.raises(ValueError, match="parts: codes of the tables"):
        gguf_4bit.stack(parts)


def test_quantize_q4_0_is_gguf_py_bytes():
    w = torch.randn(8, 256)
    w[0, :32] = 0  # an all-zero block: d = 0
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert torch.equal(gguf_4bit.quantize_q4_0(w), torch.from_numpy(want.copy()))


def test_quantize_q4_k_is_close_and_decodes_as_gguf():
    w = torch.randn(8, 512) * 0.02
    raw = gguf_4bit.quantize_q4_k(w)
    assert raw.shape == (8, 2 * 144) and raw.dtype == torch.uint8
    back = oracle(raw.reshape(-1), "Q4_K", 8, 512)
    group_range = (w.reshape(-1, 32).amax(1) - w.reshape(-1, 32).amin(1).clamp(max=0)).repeat_interleave(32)
    # a code's rounding (half a step of range / 15) plus the 6-bit rounding of scale and min
    assert ((back - w).abs().reshape(-1) <= group_range / 15).all()
    assert_values(gguf_4bit.convert(raw.reshape(-1), "Q4_K", 8, 512), 8, 512, back)
    with pytest.raises(ValueError, match="w: Q4_K rows are whole super-blocks"):
        gguf_4bit.quantize_q4_k(torch.randn(2, 96))


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="type_name: expected one of"):
        gguf_4bit.convert(torch.zeros(18, dtype=torch.uint8), "Q6_K", 1, 32)
    with pytest.raises(ValueError, match="raw: expected 36 uint8 bytes"):
        gguf_4bit.convert(torch.zeros(18, dtype=torch.uint8), "Q4_0", 2, 32)
    with pytest.raises(ValueError, match="k: a Q4_K row is whole blocks of 256"):
        gguf_4bit.convert(torch.zeros(144, dtype=torch.uint8), "Q4_K", 1, 128)
