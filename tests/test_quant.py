"""anygpu.quant: kernels bit-identical to the references, the ops, the functional API, QuantState.
(bitsandbytes itself is the oracle in test_quant_compat.py.)"""

import pytest
import torch

from anygpu import ops
from anygpu.ops.quant_common import sorted_4bit
from anygpu.ops.dequantize_4bit import reference as dequantize_4bit_reference
from anygpu.ops.dequantize_blockwise import reference as dequantize_blockwise_reference
from anygpu.ops.quantize_4bit import FP4_REFERENCE, codes_4bit, fp4_rule, pack
from anygpu.ops.quantize_4bit import reference as quantize_4bit_reference
from anygpu.ops.quantize_blockwise import reference as quantize_blockwise_reference
from anygpu.quant import create_dynamic_map, get_4bit_type
from anygpu.quant import functional as Q
from anygpu.quant.maps import dynamic_map
from anygpu.testing import same_bits  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STORAGES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)



# -- tables and maps --------------------------------------------------------------------------------


def test_4bit_tables():
    nf4, fp4 = get_4bit_type("nf4"), get_4bit_type("fp4")
    assert nf4.dtype == torch.float32 and nf4[7] == 0 and nf4[15] == 1 and nf4[0] == -1
    assert torch.all(nf4[1:] > nf4[:-1])
    assert fp4[3] == 1 and fp4[11] == -1 and fp4[1] == torch.tensor(0.0625 / 12)
    assert fp4[8] == 0 and not torch.signbit(fp4[8])  # bitsandbytes' "-0" is the int 0: code 8 is +0.0
    assert get_4bit_type("nf4") is not get_4bit_type("nf4")  # a copy: the cached table is never handed out
    with pytest.raises(ValueError, match="typename: expected 'nf4' or 'fp4', got 'int4'"):
        get_4bit_type("int4")


def test_dynamic_map_matches_the_published_table():
    signed, unsigned = create_dynamic_map(), create_dynamic_map(signed=False)
    assert signed.shape == (256,) and signed.dtype == torch.float32 and torch.all(signed[1:] > signed[:-1])
    assert signed[127] == 0 and signed[255] == 1 and abs(signed[0].item() + 0.9929687) < 1e-7
    assert abs(signed[128].item() - 5.5e-7) < 1e-12 and abs(signed[191].item() - 0.1070313) < 1e-7
    assert unsigned[0] == 0 and unsigned[255] == 1 and abs(unsigned[1].item() - 3.25e-7) < 1e-12
    assert abs(unsigned[128].item() - 0.1105469) < 1e-7
    assert torch.equal(dynamic_map(), signed)
    with pytest.raises(ValueError, match="max_exponent_bits: an unsigned map needs total_bits - 1 = 7, got 5"):
        create_dynamic_map(False, 5)
    with pytest.raises(ValueError, match=r"total_bits: expected an int in \[2, 8\], got 9"):
        create_dynamic_map(True, 7, 9)


def test_kernel_constants_are_the_tables_midpoints():
    pytest.importorskip("triton")
    from anygpu.kernels.quant_4bit import FP4_MIDPOINTS, FP4_ORDER_NIBBLES

    assert same_bits(torch.tensor(FP4_MIDPOINTS, dtype=torch.float32), sorted_4bit("fp4")[0])
    assert [(FP4_ORDER_NIBBLES >> (4 * p)) & 15 for p in range(16)] == sorted_4bit("fp4")[1].tolist()


def test_nf4_estimate_is_the_count_or_one_below_everywhere():
    """The NF4 quantize kernel's cubic (``nf4_position``), rounded, must be the count g
    of midpoints strictly below s or g - 1 for every s in [-1, 1]; the kernel's one compare with that midpoint
    then gives g exactly.  On each interval between midpoints the cubic's extremes (at the ends and its
    critical points, in fp64) keep 0.2 inside the bounds that guarantee it: fp32 evaluation moves it by ~1e-5."""
    pytest.importorskip("triton")
    import math

    from anygpu.kernels.quant_4bit import NF4_ESTIMATE

    c3, c2, c1, c0 = NF4_ESTIMATE
    cubic = lambda s: ((c3 * s + c2) * s + c1) * s + c0  # noqa: E731
    disc = c2 * c2 - 3 * c3 * c1  # critical points: 3 c3 s^2 + 2 c2 s + c1 = 0
    critical = [(-c2 + sign * math.sqrt(disc)) / (3 * c3) for sign in (1, -1)] if disc >= 0 else []
    edges = [-1.0, *sorted_4bit("nf4")[0].double().tolist(), 1.0]
    for g in range(16):  # s in (edges[g], edges[g + 1]]: g midpoints below s
        a, b = edges[g], edges[g + 1]
        ys = [cubic(s) for s in [a, b] + [c for c in critical if a < c < b]]
        low = -math.inf if g == 0 else 13.5 if g == 15 else g - 1.5  # rounds to g - 1 or more (g = 15: 14)
        high = 0.5 if g == 0 else math.inf if g == 15 else g + 0.5  # rounds to g or less
        assert low + 0.2 < min(ys) and max(ys) < high - 0.2, (g, min(ys), max(ys))
        # and rounding needs no clamp: every value on [-1, 1] rounds into [0, 14]
        assert -0.3 < min(ys) and max(ys) < 14.3, (g, min(ys), max(ys))


# -- kernels against the references (GPU, or the interpreter on the CPU) ------------------------------

# (shape, blocksize, dtype): every block size, every dtype, 1 element, partial blocks, 3-D, several
# programs, and byte counts that are not a multiple of 4 (the 4-bit kernel stores 32-bit words).
KERNEL_CASES = [
    ((1,), 64, torch.float32), ((3,), 32, torch.bfloat16), ((7, 9), 32, torch.float16),
    ((2, 3, 37), 128, torch.float32), ((5000,), 32, torch.bfloat16), ((33, 65), 256, torch.float16),
    ((4097,), 512, torch.float32), ((3, 700), 1024, torch.bfloat16), ((2049,), 2048, torch.float16),
    ((9000,), 4096, torch.float32), ((64, 64), 64, torch.bfloat16),
]


@pytest.mark.parametrize("shape,blocksize,dtype", KERNEL_CASES)
def test_blockwise_kernels_are_bit_identical(kdevice, shape, blocksize, dtype):
    from anygpu.kernels.quant_blockwise import dequantize_blockwise, quantize_blockwise

    x = (torch.randn(shape) * 3).to(dtype).to(kdevice)
    code = dynamic_map(kdevice)
    codes, absmax = quantize_blockwise(x, code, blocksize)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, code, blocksize)
    assert same_bits(codes, ref_codes) and same_bits(absmax, ref_absmax)
    out = dequantize_blockwise(codes, absmax, code, blocksize, dtype)
    assert same_bits(out, dequantize_blockwise_reference(codes, absmax, code, blocksize, dtype))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("shape,blocksize,dtype", KERNEL_CASES)
def test_4bit_kernels_are_bit_identical(kdevice, quant_type, shape, blocksize, dtype):
    from anygpu.kernels.quant_4bit import dequantize_4bit, quantize_4bit

    x = (torch.randn(shape) * 3).to(dtype).to(kdevice)
    packed, absmax = quantize_4bit(x, blocksize, quant_type, torch.uint8)
    ref_packed, ref_absmax = quantize_4bit_reference(x, blocksize, quant_type, torch.uint8)
    assert same_bits(packed, ref_packed) and same_bits(absmax, ref_absmax)
    for out_dtype in {dtype, torch.bfloat16}:
        out = dequantize_4bit(packed, absmax, blocksize, quant_type, list(shape), out_dtype)
        assert same_bits(out, dequantize_4bit_reference(packed, absmax, blocksize, quant_type, list(shape), out_dtype))


def test_ties_go_to_the_lower_code_in_kernels_and_reference(kdevice):
    """On a midpoint: the lower code; one float above it: the upper one.  Pins the kernels' thresholds
    (FP4's are literals, NF4's come from its table) to the last bit."""
    from anygpu.kernels.quant_4bit import quantize_4bit
    from anygpu.kernels.quant_blockwise import quantize_blockwise

    code = dynamic_map(kdevice)
    midpoints = (code[:-1] + code[1:]) / 2
    above = torch.nextafter(midpoints, torch.full_like(midpoints, 2.0))
    x = torch.cat([torch.ones(1, device=kdevice), midpoints, torch.ones(1, device=kdevice), above])
    codes, _ = quantize_blockwise(x, code, 256)
    assert same_bits(codes, quantize_blockwise_reference(x, code, 256)[0])
    assert codes[1:256].tolist() == list(range(255)) and codes[257:].tolist() == list(range(1, 256))
    for quant_type in ("nf4", "fp4"):  # FP4: the reference rule on any device (the GPU one: test_quant_fp4_rules)
        mids, order = sorted_4bit(quant_type, kdevice)
        above = torch.nextafter(mids, torch.full_like(mids, 2.0))
        x = torch.cat([torch.ones(1, device=kdevice), mids, above, torch.zeros(33, device=kdevice)])  # absmax 1
        packed, _ = quantize_4bit(x, 64, quant_type, torch.uint8, fp4_rule=FP4_REFERENCE)
        assert same_bits(packed, pack(codes_4bit(x, 64, quant_type, FP4_REFERENCE)[0], torch.uint8))
        nibbles = torch.stack([packed.flatten() >> 4, packed.flatten() & 15], 1).flatten().tolist()
        assert nibbles[1:16] == order[:15].tolist() and nibbles[16:31] == order[1:].tolist()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy: inf * 0
def test_nan_inf_and_zero_blocks(kdevice):
    """The documented rule, in kernels and reference alike: NaN poisons its block (absmax NaN, top code),
    inf makes absmax inf (inf -> top code, the rest -> code of 0); zero blocks scale by 1e38."""
    from anygpu.kernels.quant_4bit import dequantize_4bit, quantize_4bit
    from anygpu.kernels.quant_blockwise import quantize_blockwise

    x = torch.randn(6, 32)
    x[0, 5] = float("nan")
    x[1, 7], x[1, 9] = float("inf"), -float("inf")
    x[2] = 0.0
    x[4] = -x[4].abs()  # negative values, a -0.0 and a NaN with its sign bit set: all the top code (NaN block)
    x[4, 3] = -0.0
    x[4, 8] = torch.tensor(float("nan")).view(torch.int32).bitwise_or(-(2 ** 31)).view(torch.float32)
    x[5] = -x[5].abs()  # -inf alone: inf * 0 is NaN, the rest -0.0 (the code of +0)
    x[5, 0], x[5, 1] = -float("inf"), -0.0
    x = torch.cat([x.flatten(), torch.zeros(5)]).to(kdevice)  # a zero partial block
    code = dynamic_map(kdevice)
    codes, absmax = quantize_blockwise(x, code, 32)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, code, 32)
    assert same_bits(codes, ref_codes) and same_bits(absmax, ref_absmax)
    assert torch.isnan(absmax[0]) and torch.all(codes[:32] == 255)
    assert absmax[1] == float("inf") and codes[39] == 255 and codes[41] == 255 and codes[32] == 127
    assert absmax[2] == 0 and torch.all(codes[64:96] == 127) and absmax[6] == torch.tensor(1e-38)
    assert torch.isnan(absmax[4]) and torch.all(codes[128:160] == 255)
    assert absmax[5] == float("inf") and codes[160] == 255 and torch.all(codes[161:192] == 127)
    for quant_type in ("nf4", "fp4"):
        packed, absmax = quantize_4bit(x, 32, quant_type, torch.uint8)
        assert same_bits(packed, quantize_4bit_reference(x, 32, quant_type, torch.uint8)[0])
        out = dequantize_4bit(packed, absmax, 32, quant_type, [x.numel()], torch.float32)
        assert torch.isnan(out[:32]).all()
        # inf * (1 / inf) is NaN: the top code in the reference, code 0 (+0 * inf: NaN) in bitsandbytes' GPU FP4
        inf = float("nan") if quant_type == "fp4" and fp4_rule(x.device) != FP4_REFERENCE else float("inf")
        assert torch.allclose(out[[39, 41]].cpu(), torch.tensor([inf] * 2), 0, 0, equal_nan=True)
        assert torch.isnan(out[32])
        assert torch.all(out[64:96] == 0) and torch.all(out[192:] == 0) and torch.isfinite(out[96:128]).all()
        assert torch.isnan(out[128:160]).all() and torch.isnan(out[161:192]).all()  # code of 0 * inf


def test_kernels_read_non_contiguous_inputs_in_row_major_order(kdevice):
    from anygpu.kernels.quant_4bit import quantize_4bit
    from anygpu.kernels.quant_blockwise import quantize_blockwise

    x = torch.randn(40, 70, device=kdevice).t()
    assert same_bits(quantize_4bit(x, 64, "nf4", torch.uint8)[0],
                     quantize_4bit_reference(x.contiguous(), 64, "nf4", torch.uint8)[0])
    code = dynamic_map(kdevice)
    assert same_bits(quantize_blockwise(x, code, 64)[0], quantize_blockwise_reference(x.contiguous(), code, 64)[0])


@pytest.mark.parametrize("storage", STORAGES)
def test_quant_storage_views(kdevice, storage):
    from anygpu.kernels.quant_4bit import dequantize_4bit, quantize_4bit

    x = torch.randn(6, 40, device=kdevice)
    packed, absmax = quantize_4bit(x, 64, "fp4", storage)
    ref, _ = quantize_4bit_reference(x, 64, "fp4", storage)
    assert packed.dtype == storage and packed.shape == (120 // storage.itemsize, 1) and same_bits(packed, ref)
    assert same_bits(dequantize_4bit(packed, absmax, 64, "fp4", [6, 40], torch.float16),
                     dequantize_4bit_reference(ref, absmax, 64, "fp4", [6, 40], torch.float16))


# -- the ops ----------------------------------------------------------------------------------------


def _op_args(device):
    x = torch.randn(5, 77, device=device)
    code = dynamic_map(device)
    codes, absmax8 = ops.quantize_blockwise(x, code, 64)
    packed, absmax4 = ops.quantize_4bit(x, 32, "nf4", torch.uint8)
    return {"quantize_blockwise": (x.half(), code, 64),
            "dequantize_blockwise": (codes, absmax8, code, 64, torch.bfloat16),
            # uint8 storage: a float view of random codes holds NaN patterns, which opcheck compares unequal
            "quantize_4bit": (x, 32, "fp4", torch.uint8),
            "dequantize_4bit": (packed, absmax4, 32, "nf4", [5, 77], torch.float32)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["quantize_blockwise", "dequantize_blockwise", "quantize_4bit", "dequantize_4bit"])
def test_opcheck(device, name):
    args = _op_args(device)[name]
    torch.library.opcheck(ops.ALL_OPS[name].overload, args)


def test_ops_meta_and_compile():
    packed, absmax = ops.quantize_4bit(torch.empty(10, 7, device="meta", dtype=torch.bfloat16), 64, "nf4", torch.uint8)
    assert packed.shape == (35, 1) and absmax.shape == (2,) and absmax.dtype == torch.float32
    as_fp32, _ = ops.quantize_4bit(torch.empty(10, 8, device="meta"), 64, "nf4", torch.float32)
    assert as_fp32.shape == (10, 1) and as_fp32.dtype == torch.float32
    out = ops.dequantize_4bit(packed, absmax, 64, "nf4", [10, 7], torch.bfloat16)
    assert out.shape == (10, 7) and out.dtype == torch.bfloat16

    def roundtrip(t):
        p, a = ops.quantize_4bit(t, 64, "nf4", torch.uint8)
        return ops.dequantize_4bit(p, a, 64, "nf4", [3, 50], torch.float32)

    x = torch.randn(3, 50)
    assert torch.equal(torch.compile(roundtrip, fullgraph=True, backend="eager")(x), roundtrip(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dispatch_runs_the_kernels(dtype, monkeypatch):
    x = torch.randn(300, 257, device="cuda").to(dtype)

    def run():
        packed, state = Q.quantize_4bit(x, quant_type="nf4", compress_statistics=True)
        codes, state8 = Q.quantize_blockwise(x, blocksize=256)
        return [packed, state.absmax, state.state2.absmax, Q.dequantize_4bit(packed, state), codes, state8.absmax,
                Q.dequantize_blockwise(codes, state8)]

    triton_results = run()
    monkeypatch.setenv("ANYGPU_KERNELS", "reference")
    for ours, ref in zip(triton_results, run()):
        assert same_bits(ours, ref)
