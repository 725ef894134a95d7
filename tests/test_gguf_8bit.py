"""GGUF blocks -> the int8-block layout (``anygpu.quant.gguf_8bit``): every type bit for bit against gguf-py's
dequantization, at its own block and at 16, stacking, the Q8_0 quantizer's bytes, and the bad-input errors."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from anygpu.quant import gguf_8bit  # noqa: E402
from anygpu.quant.gguf_blocks import BLOCK_SHAPES  # noqa: E402

# byte offsets of each type's fp16 fields (d, dmin / m): random bytes there could be inf / nan
FP16_FIELDS = {"Q8_0": (0,), "Q5_0": (0,), "Q4_0": (0,), "IQ4_NL": (0,), "Q5_1": (0, 2), "Q4_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_XS": (0,)}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k / block * bytes] uint8: gguf-py's quantizer where it has one, else random bytes with finite fp16
    scales (every bit pattern of the other bytes is a valid block)."""
    rng = np.random.default_rng(seed)
    gtype = gguf.GGMLQuantizationType[type_name]
    try:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gtype)
    except NotImplementedError:
        pass
    block, size = BLOCK_SHAPES[type_name]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[type_name]:
        raw[:, at:at + 2] = (rng.random(raw.shape[0]) * 0.01 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def gguf_values(raw: np.ndarray, type_name: str, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy()).reshape(n, k)


def values(w: gguf_8bit.PackedInt8Block) -> torch.Tensor:
    """scale * q + offset in fp32, rounded once (the op's reference does the same)."""
    n, k = w.codes.shape
    v = w.codes.float().reshape(-1, w.blocksize) * w.scale[:, None]
    if w.offset is not None:
        v = v + w.offset[:, None]
    return v.reshape(n, k)


@pytest.mark.parametrize("type_name", gguf_8bit.TYPES)
def test_every_type_is_gguf_bit_for_bit(type_name):
    n, k = 6, 512
    raw = random_blocks(type_name, n, k)
    want = gguf_values(raw, type_name, n, k)
    for blocksize in {gguf_8bit.NATIVE_BLOCK[type_name], 16}:
        w = gguf_8bit.convert(torch.from_numpy(raw).reshape(-1), type_name, n, k, blocksize)
        assert w.codes.dtype == torch.int8 and w.codes.shape == (n, k) and w.blocksize == blocksize
        assert w.scale.dtype == torch.float32 and w.scale.shape == (n * k // blocksize,)
        assert (w.offset is not None) == (type_name in ("Q5_1", "Q4_1", "Q4_K", "Q5_K", "Q2_K"))
        assert torch.equal(values(w), want), (type_name, blocksize)


def test_code_ranges_fit_the_documented_ones():
    ranges = {"Q8_0": (-128, 127), "Q6_K": (-32, 31), "Q5_K": (0, 31), "Q5_0": (-16, 15), "Q5_1": (0, 31)}
    for type_name, (lo, hi) in ranges.items():
        raw = random_blocks(type_name, 64, 256, seed=1)
        if type_name in ("Q6_K", "Q5_K"):  # random bytes reach every code
            codes = gguf_8bit.convert(torch.from_numpy(raw).reshape(-1), type_name, 64, 256).codes
            assert codes.min().item() == lo and codes.max().item() == hi, type_name
        else:
            codes = gguf_8bit.convert(torch.from_numpy(raw).reshape(-1), type_name, 64, 256).codes
            assert lo <= codes.min().item() and codes.max().item() <= hi, type_name


def test_quantize_q8_0_matches_gguf_py_bytes():
    w = torch.randn(24, 256) * 3
    w[0, :32] = 0  # an all-zero block: d = 0, codes 0
    w[1, :32] = torch.arange(32) / 2 - 8  # halves: the rounding rule shows
    raw = gguf_8bit.quantize_q8_0(w)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert raw.shape == (24, 256 // 32 * 34) and np.array_equal(raw.numpy(), want)


def test_quantize_q6_k_is_valid_q6_k_within_its_step():
    """gguf-py decodes the bytes; each weight is its input rounded to the nearest of its group's stored step
    (d * sc) times a code in [-32, 31]."""
    torch.manual_seed(0)
    w = torch.randn(16, 512) * 0.02
    w[0, :256] = 0  # an all-zero super-block: d = 0, codes 32
    w[1, 5] = 0.5  # an outlier: one group's scale much larger than the others'
    raw = gguf_8bit.quantize_q6_k(w)
    assert raw.shape == (16, 2 * 210) and raw.dtype == torch.uint8
    got = gguf_values(raw.numpy(), "Q6_K", 16, 512)
    p = gguf_8bit.convert(raw.reshape(-1), "Q6_K", 16, 512)
    assert torch.equal(values(p), got)
    step = p.scale.reshape(16, 512 // 16).repeat_interleave(16, dim=1)
    nearest = torch.where(step != 0, w / step, 0).round().clamp(-32, 31) * step
    assert torch.equal(got, nearest)
    assert torch.equal(got[0, :256], torch.zeros(256)) and got[1, 5].item() == pytest.approx(0.5, rel=1e-3)
    assert (got - w).norm() / w.norm() < 0.03
    with pytest.raises(ValueError, match="w: expected \\[n, k\\] with k a multiple of 256"):
        gguf_8bit.quantize_q6_k(torch.randn(2, 128))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "Q5_K", "Q4_1"])
def test_half_scales_move_no_weight_past_the_rule(type_name):
    """``convert(..., half_scales=True)``: fp16 scale (and offset) for real quantizer output, each weight within
    2^-11 of its block's magnitude of the file's value; Q8_0's scale is the file's fp16 d, so exact."""
    raw = random_blocks(type_name, 32, 512, seed=5)
    want = gguf_values(raw, type_name, 32, 512)
    p = gguf_8bit.convert(torch.from_numpy(raw).reshape(-1), type_name, 32, 512, half_scales=True)
    assert p.scale.dtype == torch.float16 and (p.offset is None or p.offset.dtype == torch.float16)
    got = values(p._replace(scale=p.scale.float(), offset=None if p.offset is None else p.offset.float()))
    q = p.codes.reshape(-1, p.blocksize).abs().amax(dim=1).float()
    size = q * p.scale.float().abs() + (0 if p.offset is None else p.offset.float().abs())
    bound = (2.0 ** -11 * size).repeat_interleave(p.blocksize).reshape(32, 512)
    assert bool(((got - want).abs() <= bound).all())
    if type_name == "Q8_0":
        assert torch.equal(got, want)


def test_half_scales_keep_fp32_where_fp16_would_lose():
    """A scale past fp16's range (or below its normal range) keeps the whole tensor in fp32, exact."""
    raw = random_blocks("Q8_0", 2, 64, seed=6).reshape(4, 34).copy()
    raw[1, :2] = np.array([1e-7], dtype=np.float32).astype(np.float16).view(np.uint8)  # subnormal d: fp16 exact
    p = gguf_8bit.convert(torch.from_numpy(raw).reshape(-1), "Q8_0", 2, 64, half_scales=True)
    assert p.scale.dtype == torch.float16  # an fp16 d is exact in fp16 wherever it lies
    q6 = random_blocks("Q6_K", 1, 256, seed=7).copy()
    q6[0, 208:210] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # d * sc overflows fp16
    q6[0, 192] = 100
    p = gguf_8bit.convert(torch.from_numpy(q6).reshape(-1), "Q6_K", 1, 256, half_scales=True)
    assert p.scale.dtype == torch.float32 and torch.equal(values(p), gguf_values(q6, "Q6_K", 1, 256))


def test_stack_of_fp16_and_fp32_parts_is_fp32():
    parts = [gguf_8bit.convert(torch.from_numpy(random_blocks("Q8_0", 2, 256, 8)).reshape(-1), "Q8_0", 2, 256,
                               half_scales=True),
             gguf_8bit.convert(torch.from_numpy(random_blocks("Q5_K", 3, 256, 9)).reshape(-1), "Q5_K", 3, 256)]
    w = gguf_8bit.stack(parts)
    assert w.scale.dtype == w.offset.dtype == torch.float32
    assert torch.equal(values(w), torch.cat([values(parts[0]._replace(scale=parts[0].scale.float())),
                                             values(parts[1])]))


def test_stack_mixes_blocks_and_offsets():
    q4k = random_blocks("Q4_K", 8, 256, 2)
    q6k = random_blocks("Q6_K", 4, 256, 3)
    q80 = random_blocks("Q8_0", 4, 256, 4)
    bs = gguf_8bit.blocksize_for(["Q4_K", "Q6_K", "Q8_0"])
    assert bs == 16 and gguf_8bit.blocksize_for(["Q8_0", "Q5_K"]) == 32
    parts = [gguf_8bit.convert(torch.from_numpy(r).reshape(-1), t, r.shape[0], 256, bs)
             for r, t in ((q4k, "Q4_K"), (q6k, "Q6_K"), (q80, "Q8_0"))]
    w = gguf_8bit.stack(parts)
    want = torch.cat([gguf_values(q4k, "Q4_K", 8, 256), gguf_values(q6k, "Q6_K", 4, 256),
                      gguf_values(q80, "Q8_0", 4, 256)])
    assert w.codes.shape == (16, 256) and w.offset is not None and torch.equal(values(w), want)
    assert gguf_8bit.stack(parts[1:2]) is parts[1]


def test_bad_input_names_the_argument():
    raw = torch.from_numpy(random_blocks("Q8_0", 2, 64)).reshape(-1)
    with pytest.raises(ValueError, match="type_name: expected one of"):
        gguf_8bit.convert(raw, "F16", 2, 64)
    with pytest.raises(ValueError, match="raw: expected 136 uint8 bytes"):
        gguf_8bit.convert(raw[:-1], "Q8_0", 2, 64)
    with pytest.raises(ValueError, match="k: a Q8_0 row is whole blocks of 32"):
        gguf_8bit.convert(raw, "Q8_0", 4, 34)
    with pytest.raises(ValueError, match="blocksize: expected 16 or 32 and at most Q6_K's own block of 16"):
        gguf_8bit.convert(torch.from_numpy(random_blocks("Q6_K", 1, 256)).reshape(-1), "Q6_K", 1, 256, 32)
    parts = [gguf_8bit.convert(raw, "Q8_0", 2, 64), gguf_8bit.convert(raw, "Q8_0", 2, 64, 16)]
    with pytest.raises(ValueError, match="parts: expected one block size"):
        gguf_8bit.stack(parts)
    with pytest.raises(ValueError, match="types: expected GGUF types"):
        gguf_8bit.blocksize_for(["F32"])
    with pytest.raises(ValueError, match="w: expected \\[n, k\\] with k a multiple of 32"):
        gguf_8bit.quantize_q8_0(torch.randn(3, 40))
