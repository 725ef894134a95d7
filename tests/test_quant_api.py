"""anygpu.quant's functional API and QuantState on the CPU: accuracy, double quantization, buffers, the
documented quirks, bad input, and serialization (key names, JSON blob, checks)."""

import copy
import json
import pickle

import pytest
import torch

from anygpu.quant import QuantState
from anygpu.quant import functional as Q

# Mean errors on randn (bitsandbytes' test thresholds, from its CUDA kernels, which these equal).
ACCURACY_4BIT = {("nf4", 32): (0.0685, 0.192), ("nf4", 64): (0.0735, 0.206), ("fp4", 32): (0.0898, 0.245),
                 ("fp4", 64): (0.0975, 0.263)}


def _errors(x, y):
    err = (x.float() - y.float()).abs()
    return err.mean().item(), (err / (y.float().abs() + 1e-8)).mean().item()


@pytest.mark.parametrize("quant_type,blocksize", list(ACCURACY_4BIT))
@pytest.mark.parametrize("compress_statistics", [False, True])
def test_4bit_round_trip_accuracy(quant_type, blocksize, compress_statistics):
    x = torch.randn(256, 256)
    packed, state = Q.quantize_4bit(x, blocksize=blocksize, quant_type=quant_type,
                                    compress_statistics=compress_statistics)
    assert packed.shape == (256 * 128, 1) and packed.dtype == torch.uint8 and state.shape == x.shape
    out = Q.dequantize_4bit(packed, state)
    assert out.shape == x.shape and out.dtype == x.dtype
    abs_err, rel_err = _errors(out, x)
    assert abs_err < ACCURACY_4BIT[quant_type, blocksize][0] and rel_err < ACCURACY_4BIT[quant_type, blocksize][1]


@pytest.mark.parametrize("blocksize", [64, 256, 4096])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_blockwise_round_trip_accuracy(blocksize, nested, dtype):
    x = torch.randn(128, 256).to(dtype)
    codes, state = Q.quantize_blockwise(x, blocksize=blocksize, nested=nested)
    assert codes.shape == x.shape and codes.dtype == torch.uint8 and state.dtype == dtype
    out = Q.dequantize_blockwise(codes, state)
    assert out.dtype == dtype
    abs_err, rel_err = _errors(out, x)
    assert abs_err < 0.011 and rel_err < 0.018 + (0.01 if dtype == torch.bfloat16 else 0)


def test_double_quantization_state():
    x = torch.randn(64, 1000)
    _, plain = Q.quantize_4bit(x, blocksize=64, quant_type="nf4")
    packed, state = Q.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert state.nested and state.absmax.dtype == torch.uint8 and state.absmax.shape == plain.absmax.shape
    assert state.state2.blocksize == 256 and state.state2.dtype == torch.float32 and state.state2.code.shape == (256,)
    assert state.state2.absmax.shape == (-(-plain.absmax.numel() // 256),)
    assert state.offset.dim() == 0 and torch.equal(state.offset, plain.absmax.mean())
    torch.testing.assert_close(Q.dequantize_4bit(packed, state), Q.dequantize_4bit(packed, plain), atol=0.02, rtol=0.02)
    codes, state8 = Q.quantize_blockwise(x, blocksize=128, nested=True)
    assert state8.state2.blocksize == 128 and state8.absmax.dtype == torch.uint8  # bitsandbytes: the same blocksize


def test_transposed_return_of_a_packed_row():
    x = torch.randn(6, 10)
    packed, state = Q.quantize_4bit(x, quant_type="nf4")
    expected = Q.dequantize_4bit(packed, state)
    assert torch.equal(Q.dequantize_4bit(packed.t(), state), expected.t())  # the [1, bytes] row: transposed back
    tiny, tiny_state = Q.quantize_4bit(torch.randn(1, 2), quant_type="nf4")
    assert tiny.shape == (1, 1) and Q.dequantize_4bit(tiny, tiny_state).shape == (1, 2)  # a column: not transposed


def test_out_and_absmax_buffers():
    x = torch.randn(10, 64)
    out, absmax = torch.empty(320, 1, dtype=torch.uint8), torch.empty(10)
    packed, state = Q.quantize_4bit(x, absmax=absmax, out=out, quant_type="nf4")
    assert packed is out and state.absmax is absmax
    result = torch.full((10, 64), float("nan"))
    assert Q.dequantize_4bit(packed, state, out=result) is result
    assert torch.equal(result, Q.dequantize_4bit(packed, state))
    assert torch.equal(Q.dequantize_nf4(packed, absmax=absmax, out=torch.empty(10, 64)), result)
    codes = torch.empty(10, 64, dtype=torch.uint8)
    assert Q.quantize_blockwise(x, out=codes, blocksize=64)[0] is codes
    bad = torch.full((10, 63), 7.0)
    with pytest.raises(ValueError, match=r"out: expected a torch.float32 tensor of shape \(10, 64\) on cpu, got "
                                         r"torch.float32 \(10, 63\)"):
        Q.dequantize_4bit(packed, state, out=bad)
    assert torch.all(bad == 7.0)  # nothing half-written
    with pytest.raises(ValueError, match=r"absmax: expected a torch.uint8 tensor of shape \(10,\)"):
        Q.quantize_4bit(x, absmax=torch.empty(10), compress_statistics=True)


BAD_CALLS = [
    (lambda: Q.quantize_4bit(torch.ones(8, dtype=torch.int32)),
     "A: expected dtype float16, bfloat16 or float32, got torch.int32"),
    (lambda: Q.quantize_4bit(torch.ones(0, 4)), r"A: expected a non-empty tensor, got shape \(0, 4\)"),
    (lambda: Q.quantize_4bit(torch.ones(8), blocksize=48), "blocksize: expected one of 32, 64, .*, 4096, got 48"),
    (lambda: Q.quantize_4bit(torch.ones(8), quant_type="int4"), "quant_type: expected 'nf4' or 'fp4', got 'int4'"),
    (lambda: Q.quantize_4bit(torch.ones(8), quant_storage=torch.int64), "quant_storage: expected one of"),
    (lambda: Q.quantize_4bit(torch.ones(6), quant_storage=torch.float32),
     r"quant_storage: torch.float32 needs the packed codes \(3 bytes for 6 elements\) to be a multiple of 4"),
    (lambda: Q.quantize_blockwise(torch.ones(8), blocksize=16), "blocksize: expected one of 32"),
    (lambda: Q.quantize_blockwise(torch.ones(8), code=torch.zeros(16)),
     r"code: expected a float32 map of shape \(256,\)"),
    (lambda: Q.dequantize_blockwise(torch.ones(8)), "A: expected the uint8 codes of quantize_blockwise"),
    (lambda: Q.dequantize_blockwise(torch.ones(8, dtype=torch.uint8)),
     "absmax: expected a tensor when quant_state is None"),
    (lambda: Q.dequantize_blockwise(torch.ones(8, dtype=torch.uint8), absmax=torch.ones(2), blocksize=32),
     r"absmax: expected float32 of shape \(1,\) \(one per block of 32\), got torch.float32 \(2,\)"),
    (lambda: Q.dequantize_4bit(torch.ones(4, 1, dtype=torch.uint8)),
     "absmax, out: expected both when quant_state is None"),
    (lambda: Q.dequantize_4bit(torch.ones(4, 1, dtype=torch.uint8), object()), "quant_state: expected a QuantState"),
]


@pytest.mark.parametrize("call,message", BAD_CALLS)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_state_and_tensors_on_different_devices():
    packed, state = Q.quantize_4bit(torch.randn(4, 64), quant_type="nf4")
    state.absmax = state.absmax.to("meta")
    with pytest.raises(ValueError, match="absmax: expected a tensor on cpu"):
        Q.dequantize_4bit(packed, state)
    with pytest.raises(ValueError, match="A: expected 128 bytes of packed codes for shape \\(4, 64\\), got 64"):
        Q.dequantize_4bit(packed[:64], Q.quantize_4bit(torch.randn(4, 64), quant_type="nf4")[1])


# -- QuantState ---------------------------------------------------------------------------------------


def _nested_state():
    return Q.quantize_4bit(torch.randn(32, 80).to(torch.bfloat16), quant_type="nf4", compress_statistics=True)


def test_as_dict_keys_and_blob():
    packed, state = _nested_state()
    plain = state.as_dict()
    assert list(plain) == ["quant_type", "absmax", "blocksize", "quant_map", "dtype", "shape", "nested_absmax",
                           "nested_blocksize", "nested_quant_map", "nested_dtype", "nested_offset"]
    assert plain["dtype"] == "bfloat16" and plain["shape"] == (32, 80) and plain["nested_dtype"] == "float32"
    assert plain["nested_quant_map"] is not state.state2.code and isinstance(plain["nested_offset"], float)
    packed_dict = state.as_dict(packed=True)
    assert list(packed_dict) == ["absmax", "quant_map", "nested_absmax", "nested_quant_map",
                                 "quant_state.bitsandbytes__nf4"]
    blob = packed_dict["quant_state.bitsandbytes__nf4"]
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    expected = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [32, 80],
                           "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": state.offset.item()})
    assert bytes(blob.tolist()).decode() == expected
    assert torch.equal(state.bitsandbytes__nf4, blob)  # FSDP's attribute walk
    with pytest.raises(AttributeError):
        state.bitsandbytes__fp4  # noqa: B018


@pytest.mark.parametrize("packed_form", [False, True])
@pytest.mark.parametrize("prefix", ["", "model.layers.0.mlp.down_proj.weight."])
def test_from_dict_round_trip(packed_form, prefix):
    packed, state = _nested_state()
    items = {prefix + k: v for k, v in state.as_dict(packed=packed_form).items()}
    before = dict(items)
    again = QuantState.from_dict(items, device="cpu")
    assert items.keys() == before.keys()  # the caller's dict is left alone
    assert again == state and torch.equal(Q.dequantize_4bit(packed, again), Q.dequantize_4bit(packed, state))


def test_legacy_indexing_copy_pickle_and_to():
    _, state = _nested_state()
    assert state[0] is state.absmax and state[1] == (32, 80) and state[3] == 64 and state[5] == "nf4"
    assert state[4][0] is state.offset and state[4][1] is state.state2
    assert copy.deepcopy(state) == state and pickle.loads(pickle.dumps(state)) == state
    assert state.to("cpu") is state and state != QuantState(absmax=state.absmax)


def _blob(items: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(items).encode()), dtype=torch.uint8)


def _corrupt(change):
    _, state = _nested_state()
    items = state.as_dict(packed=True)
    change(items)
    return items


BAD_DICTS = [
    (lambda d: d.pop("absmax"), r"qs_dict: missing \['absmax'\]"),
    (lambda d: d.pop("nested_absmax"), r"qs_dict: missing \['nested_absmax'\]: double quantization needs"),
    (lambda d: d.update(bias=torch.zeros(1)), r"qs_dict: unexpected items \['bias'\]"),
    (lambda d: d.pop("quant_state.bitsandbytes__nf4"), "found neither"),
    (lambda d: d.update({"x.quant_state.bitsandbytes__fp4": d["quant_state.bitsandbytes__nf4"]}),
     "expected one packed quant_state item"),
    (lambda d: d.update({"quant_state.bitsandbytes__nf4": torch.tensor([1, 2, 255], dtype=torch.uint8)}),
     "quant_state.bitsandbytes__nf4: expected UTF-8 JSON text"),
    (lambda d: d.update({"quant_state.bitsandbytes__nf4": _blob({"quant_type": "fp4"})}),
     "expected its JSON to hold quant_type 'nf4'"),
    (lambda d: d.update(absmax=d["absmax"].float()), r"absmax: expected a torch.uint8 tensor of shape \(40,\)"),
    (lambda d: d.update(quant_map=torch.zeros(15)), r"quant_map: expected a torch.float32 tensor of shape \(16,\)"),
    (lambda d: d.update({"quant_state.bitsandbytes__nf4": _blob({
        "quant_type": "nf4", "blocksize": 64, "dtype": "int8", "shape": [32, 80], "nested_blocksize": 256,
        "nested_dtype": "float32", "nested_offset": 0.1})}), "dtype: expected one of 'float16', 'bfloat16', 'float32'"),
]


@pytest.mark.parametrize("change,message", BAD_DICTS)
def test_from_dict_rejects_bad_items_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        QuantState.from_dict(_corrupt(change), device="cpu")
