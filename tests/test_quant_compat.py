"""anygpu.quant against the real bitsandbytes on the CPU, the compatibility oracle.

What bitsandbytes runs on the CPU: quantize_4bit is its reference (pure-torch "default") backend, which
anygpu matches bit for bit; dequantize_4bit and the 8-bit blockwise pair are its native CPU library,
which departs from bitsandbytes' own semantics in three ways (0.50.2):

- 8-bit quantize is not round-to-nearest: about 0.2 % of codes land up to 4 codes from the nearest;
- 4-bit dequantize uses the wrong absmax for some shapes whose blocks span rows (e.g. [7, 96] at
  block size 64, [5, 64] at 128), and returns 1-D results as [1, n] ([2, 1] for n = 2).

So the bit-for-bit comparisons route those CPU ops to bitsandbytes' reference backend (the
``bnb_reference`` fixture), and the native library is compared where it is right: 8-bit codes by
agreement and by ours never being the farther code, 4-bit dequantization bit for bit on weight shapes.
"""

import functools
import io
import warnings

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: the test extra brings it "
                                                 "(pip install -e '.[test]'); it is the compatibility oracle")
import bitsandbytes.functional as BF  # noqa: E402

from anygpu.quant import QuantState, create_dynamic_map, get_4bit_type  # noqa: E402
from anygpu.quant import functional as Q  # noqa: E402
from anygpu.testing import same_bits  # noqa: E402


def same_4bit_values(a, b):
    """Bit for bit, except the sign of a zero: FP4's code 8 (sign bit, zero magnitude) decodes to -0.0 in
    bitsandbytes' CUDA kernel and its scalar CPU library, and to +0.0 through its code table (the AVX-512 and
    odd-shape CPU paths), so which one a CPU run of bitsandbytes gives depends on the machine.  Adding +0.0 maps
    -0.0 to +0.0 and leaves every other value as it is."""
    return same_bits(a + 0.0, b + 0.0)

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Odd sizes, 1 element, partial blocks, 3-D; no 2-D shape with one packed byte (bitsandbytes transposes those).
SHAPES = [(1,), (2,), (3,), (5, 7), (65,), (4, 33, 5), (130, 64)]



@pytest.fixture(scope="module", autouse=True)
def _bitsandbytes_eager():
    """bitsandbytes wraps its reference dequantize in torch.compile, compiling per shape: eager gives the
    same numbers (one fp32 multiply, one rounding) in a fraction of the time."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _redispatch(op, keys, *args, **kwargs):
    return op.redispatch(keys, *args, **kwargs)


@pytest.fixture
def bnb_reference():
    """Route bitsandbytes' native CPU quantization kernels to its reference backend for the test."""
    reference = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    lib = torch.library.Library("bitsandbytes", "IMPL")  # noqa: TOR901 - removed below, restoring the native kernels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the point
        for name in ("quantize_blockwise", "dequantize_blockwise", "dequantize_4bit"):
            op = getattr(torch.ops.bitsandbytes, name).default
            lib.impl(name, functools.partial(_redispatch, op, reference), "CPU")
    yield
    lib._destroy()


def test_maps_are_identical():
    for args in [(), (False,), (True, 5), (True, 3, 6), (False, 4, 5)]:
        assert same_bits(create_dynamic_map(*args), BF.create_dynamic_map(*args)), args
    for quant_type in ("nf4", "fp4"):
        assert same_bits(get_4bit_type(quant_type), BF.get_4bit_type(quant_type, device="cpu"))


@pytest.mark.parametrize("blocksize", BLOCKSIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_codes_and_values_are_identical(bnb_reference, quant_type, dtype, blocksize):
    for shape in SHAPES:
        x = (torch.randn(shape) * 2).to(dtype)
        packed, state = Q.quantize_4bit(x, blocksize=blocksize, quant_type=quant_type)
        bnb_packed, bnb_state = BF.quantize_4bit(x, blocksize=blocksize, quant_type=quant_type)
        assert same_bits(packed, bnb_packed) and same_bits(state.absmax, bnb_state.absmax), shape
        out = Q.dequantize_4bit(packed, state)
        assert same_4bit_values(out, BF.dequantize_4bit(bnb_packed, bnb_state)), shape
        # bitsandbytes' QuantState works too
        assert same_4bit_values(Q.dequantize_4bit(bnb_packed, bnb_state), out), shape


@pytest.mark.parametrize("storage", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
def test_quant_storage_is_identical(bnb_reference, storage):
    x = torch.randn(24, 40, dtype=torch.bfloat16)
    packed, state = Q.quantize_4bit(x, quant_type="nf4", quant_storage=storage)
    bnb_packed, bnb_state = BF.quantize_4bit(x, quant_type="nf4", quant_storage=storage)
    assert same_bits(packed, bnb_packed)
    assert same_4bit_values(Q.dequantize_4bit(packed, state), BF.dequantize_4bit(bnb_packed, bnb_state))


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_nan_inf_and_zero_blocks_are_identical(bnb_reference, quant_type):
    x = torch.randn(6, 64)
    x[0, 3], x[1, 5], x[2, 9], x[3] = float("nan"), float("inf"), -float("inf"), 0.0
    x = torch.cat([x.flatten(), torch.zeros(7)])
    packed, state = Q.quantize_4bit(x, blocksize=64, quant_type=quant_type)
    bnb_packed, bnb_state = BF.quantize_4bit(x, blocksize=64, quant_type=quant_type)
    assert same_bits(packed, bnb_packed) and same_bits(state.absmax, bnb_state.absmax)
    assert same_4bit_values(Q.dequantize_4bit(packed, state), BF.dequantize_4bit(bnb_packed, bnb_state))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_double_quantization_is_identical(bnb_reference, quant_type, dtype):
    x = torch.randn(96, 700).to(dtype)  # 1050 blocks of 64: 5 nested blocks, the last partial
    packed, state = Q.quantize_4bit(x, quant_type=quant_type, compress_statistics=True)
    bnb_packed, bnb_state = BF.quantize_4bit(x, quant_type=quant_type, compress_statistics=True)
    assert same_bits(packed, bnb_packed) and same_bits(state.absmax, bnb_state.absmax)
    assert same_bits(state.offset, bnb_state.offset) and same_bits(state.state2.absmax, bnb_state.state2.absmax)
    assert state.state2.blocksize == bnb_state.state2.blocksize == 256
    assert same_4bit_values(Q.dequantize_4bit(packed, state), BF.dequantize_4bit(bnb_packed, bnb_state))


def test_double_quantization_against_the_native_library():
    x = torch.randn(256, 1024)
    _, state = Q.quantize_4bit(x, quant_type="nf4", compress_statistics=True)
    bnb_packed, bnb_state = BF.quantize_4bit(x, quant_type="nf4", compress_statistics=True)
    assert (state.absmax == bnb_state.absmax).float().mean() > 0.99  # its library's 8-bit codes: see the docstring
    assert same_4bit_values(Q.dequantize_4bit(bnb_packed, bnb_state), BF.dequantize_4bit(bnb_packed, bnb_state))


@pytest.mark.parametrize("blocksize", BLOCKSIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_blockwise_is_identical_to_the_reference_backend(bnb_reference, dtype, blocksize):
    for shape in SHAPES:
        x = (torch.randn(shape) * 2).to(dtype)
        for nested in (False, True):
            codes, state = Q.quantize_blockwise(x, blocksize=blocksize, nested=nested)
            bnb_codes, bnb_state = BF.quantize_blockwise(x, blocksize=blocksize, nested=nested)
            assert same_bits(codes, bnb_codes) and same_bits(state.absmax, bnb_state.absmax), (shape, nested)
            out = Q.dequantize_blockwise(codes, state)
            assert same_bits(out, BF.dequantize_blockwise(bnb_codes, bnb_state)), (shape, nested)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_4bit_dequantize_matches_the_native_library_on_weight_shapes(dtype, quant_type):
    for shape in [(64, 512), (48, 1024), (3, 2, 4096)]:  # rows a multiple of the block: see the docstring
        for blocksize in (32, 64, 128, 256):
            x = torch.randn(shape).to(dtype)
            packed, state = Q.quantize_4bit(x, blocksize=blocksize, quant_type=quant_type)
            theirs = BF.dequantize_4bit(packed, state)
            assert same_4bit_values(Q.dequantize_4bit(packed, state), theirs), (shape, blocksize)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blockwise_against_the_native_library(dtype):
    x = torch.randn(512, 1024).to(dtype)
    code = create_dynamic_map()
    for blocksize in (64, 256, 4096):
        codes, state = Q.quantize_blockwise(x, blocksize=blocksize)
        bnb_codes, bnb_state = BF.quantize_blockwise(x, blocksize=blocksize)
        assert same_bits(state.absmax, bnb_state.absmax)
        assert (codes == bnb_codes).float().mean() > 0.995
        scaled = (x.float().reshape(-1, blocksize) * (1 / state.absmax[:, None])).reshape(x.shape)
        ours, theirs = (scaled - code[codes.long()]).abs(), (scaled - code[bnb_codes.long()]).abs()
        assert torch.all(ours <= theirs + 1e-7)  # where they differ, ours is the nearer code (up to a tie)
        assert same_bits(Q.dequantize_blockwise(codes, state), BF.dequantize_blockwise(codes, state))


def _round_trip(items: dict) -> dict:
    """Through a file: safetensors when installed, else torch.save / torch.load(weights_only=True)."""
    try:
        from safetensors.torch import load, save
    except ImportError:
        buffer = io.BytesIO()
        torch.save(items, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)
    return load(save({k: v.contiguous() for k, v in items.items()}))


CHECKPOINT_CASES = [("nf4", False, torch.bfloat16), ("nf4", True, torch.float16), ("fp4", True, torch.float32),
                    ("fp4", False, torch.float16)]


@pytest.mark.parametrize("quant_type,nested,dtype", CHECKPOINT_CASES)
def test_checkpoint_from_bitsandbytes_loads_in_anygpu(quant_type, nested, dtype):
    x = torch.randn(64, 320).to(dtype)
    bnb_packed, bnb_state = BF.quantize_4bit(x, quant_type=quant_type, compress_statistics=nested)
    saved = _round_trip({"layer.weight": bnb_packed, **{f"layer.weight.{k}": v
                                                       for k, v in bnb_state.as_dict(packed=True).items()}})
    state = QuantState.from_dict({k: v for k, v in saved.items() if k != "layer.weight"}, device="cpu")
    assert same_4bit_values(Q.dequantize_4bit(saved["layer.weight"], state), BF.dequantize_4bit(bnb_packed, bnb_state))
    unpacked = QuantState.from_dict(bnb_state.as_dict(packed=False), device="cpu")
    assert same_4bit_values(Q.dequantize_4bit(bnb_packed, unpacked), BF.dequantize_4bit(bnb_packed, bnb_state))


@pytest.mark.parametrize("quant_type,nested,dtype", CHECKPOINT_CASES)
def test_checkpoint_from_anygpu_loads_in_bitsandbytes(quant_type, nested, dtype):
    x = torch.randn(64, 320).to(dtype)
    packed, state = Q.quantize_4bit(x, quant_type=quant_type, compress_statistics=nested)
    saved = _round_trip({"layer.weight": packed, **{f"layer.weight.{k}": v
                                                   for k, v in state.as_dict(packed=True).items()}})
    bnb_state = BF.QuantState.from_dict({k: v for k, v in saved.items() if k != "layer.weight"}, device="cpu")
    assert same_4bit_values(BF.dequantize_4bit(saved["layer.weight"], bnb_state), Q.dequantize_4bit(packed, state))
    bnb_unpacked = BF.QuantState.from_dict(state.as_dict(packed=False), device="cpu")
    assert same_4bit_values(BF.dequantize_4bit(packed, bnb_unpacked), Q.dequantize_4bit(packed, state))


@pytest.mark.parametrize("nested", [False, True])
def test_serialized_state_is_the_same_bytes(bnb_reference, nested):
    x = torch.randn(48, 200, dtype=torch.bfloat16)
    _, state = Q.quantize_4bit(x, quant_type="nf4", compress_statistics=nested)
    _, bnb_state = BF.quantize_4bit(x, quant_type="nf4", compress_statistics=nested)
    ours, theirs = state.as_dict(packed=True), bnb_state.as_dict(packed=True)
    assert list(ours) == list(theirs)
    for key in ours:
        assert same_bits(ours[key], theirs[key]), key  # the JSON blob included: same text, byte for byte
    plain, bnb_plain = state.as_dict(), bnb_state.as_dict()
    assert list(plain) == list(bnb_plain)
    assert all(plain[k] == bnb_plain[k] for k in plain if not isinstance(plain[k], torch.Tensor))


def test_transposed_return_differs_only_for_a_single_byte_column():
    x = torch.randn(6, 10)
    packed, state = Q.quantize_4bit(x, quant_type="nf4")
    bnb_packed, bnb_state = BF.quantize_4bit(x, quant_type="nf4")
    assert same_4bit_values(Q.dequantize_4bit(packed.t(), state), BF.dequantize_4bit(bnb_packed.t(), bnb_state))
    tiny = torch.randn(1, 2)
    packed, state = Q.quantize_4bit(tiny, quant_type="nf4")
    bnb_out = BF.dequantize_4bit(*BF.quantize_4bit(tiny, quant_type="nf4"))
    ours = Q.dequantize_4bit(packed, state)
    assert ours.shape == (1, 2) and bnb_out.shape == (2, 1) and same_bits(ours, bnb_out.t())  # documented difference
