"""anygpu.nn's 4-bit modules and quantize_model, on the CPU, with the real bitsandbytes as the oracle.

The matmul behind Linear4bit runs its PyTorch reference here; its Triton kernels are tested in
test_matmul_4bit.py.  Two ops of bitsandbytes' native CPU library are not its reference semantics: the
8-bit quantize behind double quantization is not round-to-nearest, and dequantize_4bit is wrong for 2-D
weights whose rows are not a multiple of the block (IN = 96 here, on purpose: blocks span rows).  The
``bnb_reference`` fixture routes both to bitsandbytes' reference backend; one test checks the native
library on a block-aligned shape.
"""

import copy
import gc
import inspect
import io
import logging
import math
import pickle
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from anygpu.nn import Linear4bit, LinearFP4, LinearNF4, Params4bit, QuantizeReport, quantize_model
from anygpu.quant import dequantize_4bit, quantize_4bit

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is the compatibility oracle (test extra)")
import bitsandbytes.functional as BF  # noqa: E402
from anygpu.testing import same_bits  # noqa: E402

IN, OUT = 96, 40  # 3840 weights: 60 blocks of 64 spanning rows; bf16 storage holds 960 values
CASES = [(qt, nested, bias, storage) for qt in ("nf4", "fp4") for nested in (False, True) for bias in (True, False)
         for storage in (torch.uint8, torch.bfloat16)]
CASE_IDS = [f"{qt}-{'dq' if n else 'nodq'}-{'bias' if b else 'nobias'}-{str(s)[6:]}" for qt, n, b, s in CASES]


@pytest.fixture(scope="module", autouse=True)
def _eager():
    """bitsandbytes wraps some CPU paths in torch.compile: eager gives the same numbers, much sooner."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _to_reference(op):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return lambda *args: op.redispatch(keys, *args)


@pytest.fixture
def bnb_reference():
    lib = torch.library.Library("bitsandbytes", "IMPL")  # noqa: TOR901 - destroyed below: the native kernels return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for name in ("quantize_blockwise", "dequantize_4bit"):
            lib.impl(name, _to_reference(getattr(torch.ops.bitsandbytes, name).default), "CPU")
    yield
    lib._destroy()



def same_state_dict(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(same_bits(a[k], b[k]) for k in a)


def dequantized(layer) -> torch.Tensor:
    return dequantize_4bit(layer.weight.data, layer.weight.quant_state)


def fp_linear(bias=True, dtype=torch.float32, in_features=IN, out_features=OUT) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.mul_(8.0)  # beyond [-1, 1], so absmax scaling matters
    return linear


def quantized_pair(quant_type, nested, bias, storage, dtype=torch.float32):
    """(ours, bitsandbytes') Linear4bit with the same weights, quantized the documented way: load an
    nn.Linear state_dict, then move to the device."""
    source = fp_linear(bias, dtype)
    layers = []
    for cls in (Linear4bit, bnb.nn.Linear4bit):
        layer = cls(IN, OUT, bias=bias, compress_statistics=nested, quant_type=quant_type, quant_storage=storage)
        layer.load_state_dict(source.state_dict())
        layers.append(layer.to(dtype).to("cpu"))
    return layers


# -- constructors ---------------------------------------------------------------------------------


def _params(fn, skip=("self", "cls", "kwargs", "args")):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in skip]


def test_constructors_match_bitsandbytes():
    assert _params(Params4bit.__new__) == _params(bnb.nn.Params4bit.__new__)
    assert _params(Params4bit.from_prequantized) == _params(bnb.nn.Params4bit.from_prequantized)
    ours = _params(Linear4bit.__init__)
    assert ours[:len(_params(bnb.nn.Linear4bit.__init__))] == _params(bnb.nn.Linear4bit.__init__)
    assert ours[len(_params(bnb.nn.Linear4bit.__init__)):] == [("blocksize", None)]  # our one addition, last
    for cls, theirs in ((LinearNF4, bnb.nn.LinearNF4), (LinearFP4, bnb.nn.LinearFP4)):
        assert _params(cls.__init__) == _params(theirs.__init__)


def test_params4bit_defaults_and_dict_match_bitsandbytes():
    data = torch.randn(8, 64)
    ours, theirs = Params4bit(data), bnb.nn.Params4bit(data)
    assert sorted(ours.__dict__) == sorted(theirs.__dict__)
    for name in theirs.__dict__:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert not ours.requires_grad and ours.blocksize == 64 and ours.quant_type == "fp4" and ours.compress_statistics
    assert Params4bit().numel() == 0


def test_linear4bit_attributes():
    layer = LinearNF4(IN, OUT, compute_dtype=torch.bfloat16, compress_statistics=False)
    assert layer.weight.quant_type == "nf4" and not layer.weight.compress_statistics
    assert layer.compute_dtype == torch.bfloat16 and layer.compute_type_is_set and layer.quant_state is None
    assert LinearFP4(IN, OUT).weight.quant_type == "fp4" and Linear4bit(IN, OUT).weight.quant_type == "fp4"
    assert layer.weight.module is layer and not layer.weight.requires_grad and not layer.weight.bnb_quantized


# -- quantize on move ------------------------------------------------------------------------------


@pytest.mark.parametrize("move", ["to", "cpu", "module_to"])
def test_move_quantizes(move):
    source = fp_linear()
    layer = Linear4bit(IN, OUT, quant_type="nf4", compress_statistics=False)
    layer.load_state_dict(source.state_dict())
    param = layer.weight
    if move == "to":
        assert layer.weight.to("cpu") is param  # quantized in place, so nn.Module.to keeps the object
    elif move == "cpu":
        layer.weight.cpu()
    else:
        layer.to(torch.device("cpu"))
    assert layer.weight is param and param.bnb_quantized and layer.quant_state is param.quant_state
    packed, state = quantize_4bit(source.weight.detach(), quant_type="nf4")
    assert same_bits(param.data, packed) and same_bits(param.quant_state.absmax, state.absmax)


def test_meta_and_dtype_moves_do_not_quantize():
    layer = Linear4bit(IN, OUT)
    layer.to(torch.bfloat16)
    assert not layer.weight.bnb_quantized and layer.weight.dtype == torch.bfloat16 and layer.weight.shape == (OUT, IN)
    assert isinstance(layer.weight, Params4bit)
    meta = Linear4bit(IN, OUT, device="meta").to("meta")
    assert not meta.weight.bnb_quantized and meta.weight.is_meta
    with pytest.raises(ValueError, match="weight: on the meta device"):
        meta(torch.randn(2, IN))


def test_moving_a_quantized_weight_keeps_state_and_bytes():
    layer = Linear4bit(IN, OUT, quant_type="nf4", quant_storage=torch.bfloat16).to("cpu")
    state, packed = layer.weight.quant_state, layer.weight.data.clone()
    moved = layer.weight.to("cpu", torch.float16)  # a dtype is ignored once quantized: the bytes are not values
    assert isinstance(moved, Params4bit) and moved.quant_state is state and moved.bnb_quantized
    assert same_bits(moved.data, packed)
    layer.half()
    layer.to(torch.float32)
    assert same_bits(layer.weight.data, packed) and layer.weight.quant_state is state
    on_meta = copy.deepcopy(layer.weight).to("meta")  # the state moves with the bytes
    assert on_meta.is_meta and on_meta.quant_state.absmax.is_meta and on_meta.bnb_quantized
    assert on_meta.quant_state.state2.absmax.is_meta and not state.absmax.is_meta


def test_forward_quantizes_a_layer_never_moved():
    layer = Linear4bit(IN, OUT, quant_type="fp4")
    y = layer(torch.randn(3, IN))
    assert layer.weight.bnb_quantized and y.shape == (3, OUT)


# -- forward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_dequantized_reference(quant_type, nested, dtype):
    layer = Linear4bit.from_linear(fp_linear(), quant_type, compress_statistics=nested)
    x = torch.randn(2, 5, IN, dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (2, 5, OUT) and layer.compute_dtype == dtype  # adopted from the input
    expected = F.linear(x, dequantized(layer).to(dtype), layer.bias.to(dtype))
    torch.testing.assert_close(y, expected, rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-5)


def test_compute_dtype_rules():
    linear = fp_linear()
    layer = Linear4bit.from_linear(linear, "nf4", compute_dtype=torch.bfloat16)
    x = torch.randn(4, IN)
    y = layer(x)  # fp32 in, bf16 compute, fp32 out
    expected = F.linear(x.bfloat16(), dequantized(layer).bfloat16(), layer.bias.bfloat16()).float()
    assert y.dtype == torch.float32 and torch.equal(y, expected) and layer.bias.dtype == torch.float32

    unset = Linear4bit.from_linear(linear, "nf4")
    with pytest.warns(UserWarning, match="float16 and compute_dtype is unset"):
        y16 = unset(x.half())
    assert y16.dtype == torch.float16 and unset.compute_dtype is None
    torch.testing.assert_close(y16, F.linear(x.half(), dequantized(unset).half(), unset.bias.half()))

    upcast = Linear4bit.from_linear(linear, "nf4", compute_dtype=torch.float32)
    with pytest.warns(UserWarning, match="upcast"):
        assert upcast(x.half()).dtype == torch.float16


# -- state_dict: bitsandbytes' format, both directions ---------------------------------------------


@pytest.mark.parametrize("quant_type, nested, bias, storage", CASES, ids=CASE_IDS)
def test_state_dict_is_bitsandbytes(bnb_reference, quant_type, nested, bias, storage):
    ours, theirs = quantized_pair(quant_type, nested, bias, storage)
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert same_state_dict(ours_sd, theirs_sd)  # same keys, dtypes, shapes, bytes (JSON blob included)
    blob = f"weight.quant_state.bitsandbytes__{quant_type}"
    assert blob in ours_sd and ("weight.nested_absmax" in ours_sd) == nested and ("bias" in ours_sd) == bias
    assert ours_sd["weight"].dtype == storage


@pytest.mark.parametrize("quant_type, nested, bias, storage", CASES, ids=CASE_IDS)
def test_bitsandbytes_state_dict_loads_into_ours(bnb_reference, quant_type, nested, bias, storage):
    _, theirs = quantized_pair(quant_type, nested, bias, storage)
    theirs_sd = theirs.state_dict()
    x = torch.randn(3, IN)
    expected = F.linear(x, BF.dequantize_4bit(theirs.weight.data, theirs.weight.quant_state),
                        theirs.bias if bias else None)
    for device in ("cpu", "meta"):  # a fresh layer, and one built empty and assigned to, as transformers does
        ours = Linear4bit(IN, OUT, bias=bias, device=device)  # fp4 by default: the checkpoint's type wins
        result = ours.load_state_dict(theirs_sd, strict=True, assign=device == "meta")
        assert not result.missing_keys and not result.unexpected_keys
        assert ours.weight.quant_type == quant_type and ours.weight.quant_storage == storage
        assert ours.weight.compress_statistics == nested and ours.quant_state is ours.weight.quant_state
        assert same_state_dict(ours.state_dict(), theirs_sd)
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        if device == "cpu":
            assert ours.weight.data_ptr() != theirs_sd["weight"].data_ptr()  # copied, not aliased


@pytest.mark.parametrize("quant_type, nested, bias, storage", CASES, ids=CASE_IDS)
def test_our_state_dict_loads_into_bitsandbytes(bnb_reference, quant_type, nested, bias, storage):
    """The way transformers loads a prequantized checkpoint into bitsandbytes: from_prequantized."""
    ours, _ = quantized_pair(quant_type, nested, bias, storage)
    sd = ours.state_dict()
    theirs = bnb.nn.Linear4bit(IN, OUT, bias=bias, quant_type=quant_type)
    stats = {k.removeprefix("weight."): v for k, v in sd.items() if k.startswith("weight.")}
    theirs.weight = bnb.nn.Params4bit.from_prequantized(sd["weight"], stats, device="cpu", module=theirs)
    if bias:
        theirs.bias = nn.Parameter(sd["bias"])
    assert same_state_dict(theirs.state_dict(), sd)
    assert same_bits(BF.dequantize_4bit(theirs.weight.data, theirs.weight.quant_state), dequantized(ours))
    x = torch.randn(3, IN)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bitsandbytes_native_cpu_forward_on_aligned_rows(quant_type):
    """bitsandbytes' own CPU library (no rerouting), where it is right: rows a multiple of the block."""
    theirs = bnb.nn.Linear4bit(128, 48, quant_type=quant_type).to("cpu")
    ours = Linear4bit(128, 48, quant_type=quant_type)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 128)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours(x.bfloat16()), theirs(x.bfloat16()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_state_dict_of_half_precision_weights(bnb_reference, dtype):
    ours, theirs = quantized_pair("nf4", True, True, torch.uint8, dtype)
    sd = ours.state_dict()
    assert same_state_dict(sd, theirs.state_dict()) and ours.weight.quant_state.dtype == dtype
    again = Linear4bit(IN, OUT)
    again.load_state_dict(sd)
    assert again.weight.quant_state.dtype == dtype and same_bits(dequantized(again), dequantized(ours))


def test_state_dict_through_torch_save_without_pickle():
    ours, _ = quantized_pair("nf4", True, True, torch.bfloat16)
    sd = ours.state_dict()
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # tensors only: nothing to unpickle but tensors
    again = Linear4bit(IN, OUT)
    again.load_state_dict(loaded)
    assert same_state_dict(again.state_dict(), sd)


def test_state_dict_through_safetensors_both_ways(bnb_reference, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    ours, theirs = quantized_pair("nf4", True, True, torch.bfloat16)
    path = str(tmp_path / "layer.safetensors")

    safetensors.save_file(theirs.state_dict(), path)  # bitsandbytes -> file -> anygpu
    loaded = Linear4bit(IN, OUT)
    loaded.load_state_dict(safetensors.load_file(path))
    assert same_state_dict(loaded.state_dict(), ours.state_dict())

    safetensors.save_file(ours.state_dict(), path)  # anygpu -> file -> bitsandbytes
    from_file = safetensors.load_file(path)
    theirs_loaded = bnb.nn.Linear4bit(IN, OUT, quant_type="nf4")
    stats = {k.removeprefix("weight."): v for k, v in from_file.items() if k.startswith("weight.")}
    theirs_loaded.weight = bnb.nn.Params4bit.from_prequantized(from_file["weight"], stats, device="cpu")
    theirs_loaded.bias = nn.Parameter(from_file["bias"])
    assert same_state_dict(theirs_loaded.state_dict(), ours.state_dict())


def test_full_precision_state_dict_into_a_quantized_layer():
    source = fp_linear()
    layer = Linear4bit(IN, OUT, quant_type="fp4", compress_statistics=False).to("cpu")
    layer.load_state_dict(source.state_dict())  # quantized at once, with the layer's settings
    packed, _ = quantize_4bit(source.weight.detach(), quant_type="fp4")
    assert layer.weight.bnb_quantized and same_bits(layer.weight.data, packed)


def test_bad_state_dicts():
    ours, _ = quantized_pair("nf4", True, True, torch.uint8)
    sd = ours.state_dict()
    small = Linear4bit(IN, OUT // 2)
    with pytest.raises(ValueError, match="expected a quant state of shape"):
        small.load_state_dict(sd)
    with pytest.raises(ValueError, match="nested_quant_map"):
        Linear4bit(IN, OUT).load_state_dict({k: v for k, v in sd.items() if k != "weight.nested_quant_map"})
    with pytest.raises(RuntimeError, match="packed weight itself"):
        Linear4bit(IN, OUT).load_state_dict({k: v for k, v in sd.items() if k != "weight"})
    with pytest.raises(RuntimeError, match="full-precision"):
        Linear4bit(IN, OUT).load_state_dict({"weight": torch.zeros(3, 3), "bias": sd["bias"]})
    result = Linear4bit(IN, OUT).load_state_dict({"bias": sd["bias"]}, strict=False)
    assert result.missing_keys == ["weight"]


# -- Params4bit: from_prequantized, rebuilding, copies, FSDP-facing attributes ----------------------


def test_from_prequantized():
    ours, theirs = quantized_pair("fp4", True, False, torch.bfloat16)
    sd = theirs.state_dict()
    stats = {k.removeprefix("weight."): v for k, v in sd.items() if k.startswith("weight.")}
    module = Linear4bit(IN, OUT, bias=False, device="meta")
    param = Params4bit.from_prequantized(sd["weight"], stats, device="cpu", module=module)
    assert param.bnb_quantized and not param.requires_grad and param.module is module
    assert (param.blocksize, param.quant_type, param.compress_statistics, param.quant_storage) == \
        (64, "fp4", True, torch.bfloat16)
    assert module.quant_state is param.quant_state and param.quant_state.shape == (OUT, IN)
    assert same_bits(dequantize_4bit(param.data, param.quant_state), dequantized(ours))
    with pytest.raises(ValueError, match="absmax"):
        Params4bit.from_prequantized(sd["weight"], {k: v for k, v in stats.items() if k != "absmax"}, device="cpu")
    with pytest.raises(ValueError, match="data"):
        Params4bit.from_prequantized(sd["weight"].to(torch.int32), stats, device="cpu")


def test_rebuild_from_dict_as_peft_does():
    layer = Linear4bit.from_linear(fp_linear(), "nf4")
    old = layer.weight
    same = Params4bit(old.data, requires_grad=False, **old.__dict__)
    assert same.quant_state is old.quant_state and same.bnb_quantized and same.module is layer
    assert same_bits(same.data, old.data)
    # merging an adapter: dequantize, change, quantize again with the same settings
    merged = dequantized(layer) + 0.01
    kwargs = {**old.__dict__, "bnb_quantized": False, "quant_state": None}
    requantized = Params4bit(merged, requires_grad=False, **kwargs).to("cpu")
    packed, _ = quantize_4bit(merged, quant_type="nf4", compress_statistics=True)
    assert requantized.bnb_quantized and same_bits(requantized.data, packed)
    assert Params4bit(old.data, unknown_attribute=1, **old.__dict__).bnb_quantized  # extras ignored


def test_copy_deepcopy_pickle():
    layer = Linear4bit.from_linear(fp_linear(), "nf4")
    shallow = copy.copy(layer.weight)
    assert shallow.quant_state is layer.weight.quant_state and shallow.data_ptr() == layer.weight.data_ptr()
    deep = copy.deepcopy(layer)
    assert deep.weight.module is deep and deep.weight.quant_state is not layer.weight.quant_state
    assert deep.weight.quant_state == layer.weight.quant_state and deep.weight.data_ptr() != layer.weight.data_ptr()
    loaded = pickle.loads(pickle.dumps(layer))
    x = torch.randn(2, IN)
    for other in (deep, loaded):
        assert isinstance(other.weight, Params4bit) and torch.equal(other(x), layer(x))
    assert loaded.weight.module is loaded


@pytest.mark.parametrize("make", [lambda: Linear4bit.from_linear(fp_linear(), "nf4"),
                                  lambda: Linear4bit(IN, OUT, quant_type="fp4").to("cpu")])
def test_a_dropped_layer_is_freed_without_the_garbage_collector(make):
    # The param's reference to its layer is weak: no layer <-> weight cycle, so `del model` frees the memory at
    # once (with a strong one, as in bitsandbytes, only the next gc.collect() would).
    gc.collect()
    gc.disable()
    try:
        layer = make()
        layer(torch.randn(2, IN))
        assert layer.weight.module is layer and layer.weight.bnb_quantized
        rebuilt = Params4bit(layer.weight.data, requires_grad=False, **layer.weight.__dict__)
        assert rebuilt.module is layer  # PEFT's rebuild from __dict__ keeps the link
        freed = weakref.ref(layer), weakref.ref(layer.weight), weakref.ref(rebuilt)
        del layer, rebuilt
        assert all(ref() is None for ref in freed)
    finally:
        gc.enable()


def test_fsdp_facing_attributes_match_bitsandbytes(bnb_reference):
    ours, theirs = quantized_pair("nf4", True, True, torch.uint8)
    for name in ("absmax", "code", "quant_map", "offset", "nested_absmax", "nested_quant_map"):
        assert same_bits(getattr(ours.weight, name), getattr(theirs.weight, name)), name
    assert ours.weight.nested_blocksize == 256 and ours.weight.nested_dtype == torch.float32
    assert ours.weight.state2 is ours.weight.quant_state.state2
    with pytest.raises(AttributeError):
        Params4bit(torch.randn(4, 64)).absmax
    with pytest.raises(AttributeError):
        Linear4bit.from_linear(fp_linear(), "nf4", compress_statistics=False).weight.nested_absmax


def test_plain_parameter_gets_its_state_back():
    """FSDP can swap the Params4bit for a plain Parameter over the same bytes; the module re-attaches it."""
    layer = Linear4bit.from_linear(fp_linear(), "nf4")
    x = torch.randn(2, IN)
    expected = layer(x)
    layer.weight = nn.Parameter(layer.weight.data, requires_grad=False)
    assert torch.equal(layer(x), expected) and isinstance(layer.weight, Params4bit)


# -- quantize_model ----------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn, self.mlp = Attention(dim, heads), MLP(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLM(nn.Module):
    """The layout of a Llama-style transformers model: model.embed_tokens, model.layers.N.{self_attn,mlp}.*_proj,
    lm_head tied to the embedding."""

    def __init__(self, vocab=100, dim=64, heads=4, hidden=128, layers=2):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, dim)
        self.model.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.model.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]
ALL_LINEARS = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS]


def _expected_bytes_4bit(linear: nn.Linear, nested: bool) -> int:
    n = linear.weight.numel()
    blocks = math.ceil(n / 64)
    size = n // 2 + 16 * 4  # packed codes, the 16-entry table
    size += blocks + 4 + math.ceil(blocks / 256) * 4 + 256 * 4 if nested else blocks * 4  # absmax (+ nested)
    return size + (linear.bias.numel() * linear.bias.element_size() if linear.bias is not None else 0)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_quantize_model_replaces_every_linear_but_lm_head(quant_type, caplog):
    model = TinyLM().eval()
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        reference = model(ids)
    linears = dict(model.named_modules())
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    expected_after = before - sum(linears[n].weight.numel() * 4 + (linears[n].bias.numel() * 4 if linears[n].bias
                                                                   is not None else 0) for n in ALL_LINEARS)
    expected_after += sum(_expected_bytes_4bit(linears[n], nested=True) for n in ALL_LINEARS)
    weights = [weakref.ref(linears[n].weight) for n in ALL_LINEARS]
    del linears

    with caplog.at_level(logging.INFO, logger="anygpu.nn.quantize_model"):
        report = quantize_model(model, quant_type, progress=False)
    assert isinstance(report, QuantizeReport) and report.quant_type == quant_type
    assert report.replaced == ALL_LINEARS and report.skipped == ["lm_head"]
    assert report.parameter_bytes_before == before and report.parameter_bytes_after == expected_after
    assert report.saved_bytes > 0 and report.ratio < 0.5
    assert report.active_memory_before > 0 and report.active_memory_after > 0 and report.backend == "cpu"
    assert "quantize_model: 14 nn.Linear" in caplog.text and "parameter bytes" in str(report)

    modules = dict(model.named_modules())
    assert all(type(modules[n]) is Linear4bit and modules[n].weight.quant_type == quant_type for n in ALL_LINEARS)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    gc.collect()
    assert all(ref() is None for ref in weights)  # no full-precision copy kept
    with torch.no_grad():
        out = model(ids)
    assert (out - reference).norm() / reference.norm() < 0.1


def test_quantize_model_options_and_progress_bar(capsys):
    model = TinyLM(layers=1)
    report = quantize_model(model, "fp4", skip=(), compute_dtype=torch.bfloat16, blocksize=128,
                            compress_statistics=False, quant_storage=torch.bfloat16, device="cpu")
    assert "quantize fp4" in capsys.readouterr().err  # the tqdm bar
    assert "lm_head" in report.replaced and report.skipped == []
    head = model.lm_head
    assert isinstance(head, Linear4bit) and head.compute_dtype == torch.bfloat16
    state = head.weight.quant_state
    assert (state.quant_type, state.blocksize, state.nested, head.weight.dtype) == \
        ("fp4", 128, False, torch.bfloat16)
    assert model(torch.randint(0, 100, (1, 5))).dtype == torch.float32
    with pytest.raises(ValueError, match="model: expected at least one torch.nn.Linear"):
        quantize_model(model, "nf4", progress=False)  # already quantized: nothing left


@pytest.mark.parametrize("skip, kept", [
    ("mlp", [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]),
    (["layers.1", "lm_head"], [n for n in ALL_LINEARS if ".1." in n]),
    ("*.o_proj", ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]),
    (("q_proj", "k_*"), [n for n in ALL_LINEARS if "q_proj" in n or "k_proj" in n]),
])
def test_skip_patterns(skip, kept):
    model = TinyLM()
    report = quantize_model(model, "nf4", skip=skip, progress=False)
    modules = dict(model.named_modules())
    left = [n for n in ALL_LINEARS + ["lm_head"] if type(modules[n]) is nn.Linear]
    expected = sorted(set(kept) | ({"lm_head"} if "lm_head" in str(skip) else set()))
    assert sorted(left) == expected and sorted(report.skipped) == expected
    assert sorted(report.replaced) == sorted(set(ALL_LINEARS + ["lm_head"]) - set(expected))


def test_multihead_attention_out_proj_is_left_alone():
    model = nn.Sequential(nn.Linear(32, 32), nn.MultiheadAttention(32, 4, batch_first=True))
    report = quantize_model(model, "nf4", progress=False)
    assert report.replaced == ["0"] and report.skipped == ["1.out_proj"]
    x = model[0](torch.randn(2, 3, 32))
    assert model[1](x, x, x)[0].shape == (2, 3, 32)


def test_shared_layer_is_quantized_once():
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = quantize_model(model, "nf4", progress=False)
    assert report.replaced == ["0", "2"] and model[0] is model[2] and isinstance(model[0], Linear4bit)


@pytest.mark.parametrize("kwargs, message", [
    ({"quant_type": "int4"}, "quant_type: expected one of 'nf4', 'fp4'"),
    ({"skip": "lmhead"}, r"skip: the patterns \['lmhead'\] match no nn.Linear"),
    ({"skip": ["model", "lm_head"]}, "skip: the patterns .* exclude every nn.Linear"),
    ({"skip": [3]}, "skip: expected non-empty strings"),
    ({"skip": 3}, "skip: expected a module-name pattern"),
    ({"blocksize": 48}, "blocksize: expected one of"),
    ({"quant_storage": torch.int32}, "quant_storage: expected one of"),
    ({"compute_dtype": torch.int8}, "compute_dtype: expected None"),
    ({"device": "meta"}, "device: expected a real device"),
    ({"device": "nowhere"}, "device: expected a torch device"),
])
def test_quantize_model_errors(kwargs, message):
    model = TinyLM(layers=1)
    with pytest.raises(ValueError, match=message):
        quantize_model(model, **{"quant_type": "nf4", "progress": False, **kwargs})
    assert all(type(m) is not Linear4bit for m in model.modules())  # checked before anything changed


def test_quantize_model_bad_models():
    with pytest.raises(ValueError, match="meta device: load the weights first"):
        quantize_model(nn.Sequential(nn.Linear(8, 8, device="meta")), progress=False)
    with pytest.raises(ValueError, match="model: expected a torch.nn.Module"):
        quantize_model("gpt2")
    with pytest.raises(ValueError, match="model: expected a model containing"):
        quantize_model(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="model: expected at least one torch.nn.Linear"):
        quantize_model(nn.Sequential(nn.Embedding(4, 4)))


def test_module_argument_errors():
    with pytest.raises(ValueError, match="quant_type"):
        Linear4bit(IN, OUT, quant_type="nf5")
    with pytest.raises(ValueError, match="compute_dtype"):
        Linear4bit(IN, OUT, compute_dtype="bf16")
    with pytest.raises(ValueError, match="blocksize"):
        Params4bit(torch.randn(4), blocksize=100)
    with pytest.raises(ValueError, match="quant_storage"):
        Params4bit(torch.randn(4), quant_storage=torch.int64)
    with pytest.raises(ValueError, match="data"):
        Params4bit([1.0, 2.0])
    with pytest.raises(ValueError, match="linear"):
        Linear4bit.from_linear(nn.Conv1d(2, 2, 1))


# -- autograd: QLoRA ---------------------------------------------------------------------------------


class LoRA(nn.Module):
    """y = base(x) + scale * B(A(x)), base frozen."""

    def __init__(self, base: nn.Module, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = base
        self.A = nn.Linear(base.in_features, rank, bias=False)
        self.B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.B.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.scale * self.B(self.A(x))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_gradients_flow_to_the_input_through_frozen_weights(quant_type):
    layer = Linear4bit.from_linear(fp_linear(), quant_type)
    layer.bias.requires_grad_(True)
    x = torch.randn(2, 3, IN, requires_grad=True)
    layer(x).square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    bias_ref = layer.bias.detach().clone().requires_grad_(True)
    F.linear(x_ref, dequantized(layer), bias_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, bias_ref.grad, rtol=1e-5, atol=1e-4)
    assert layer.weight.grad is None and not layer.weight.requires_grad


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_lora_gradients_match_a_dequantized_reference(compute_dtype):
    quantized = LoRA(Linear4bit.from_linear(fp_linear(), "nf4", compute_dtype=compute_dtype))
    nn.init.normal_(quantized.B.weight, std=0.1)  # nonzero, so A gets a gradient too
    reference_base = nn.Linear(IN, OUT)
    with torch.no_grad():
        reference_base.weight.copy_(dequantized(quantized.base))
        reference_base.bias.copy_(quantized.base.bias)
    reference_base.requires_grad_(False)
    reference = LoRA(reference_base)
    reference.load_state_dict({"A.weight": quantized.A.weight, "B.weight": quantized.B.weight}, strict=False)

    x = torch.randn(8, IN)
    target = torch.randn(8, OUT)
    grads = []
    for model in (quantized, reference):
        xi = x.clone().requires_grad_(True)
        F.mse_loss(model(xi), target).backward()
        grads.append((model.A.weight.grad, model.B.weight.grad, xi.grad))
    tol = {"rtol": 1e-4, "atol": 1e-6} if compute_dtype is None else {"rtol": 0.05, "atol": 2e-3}
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, **tol)


def test_lora_trains_through_linear4bit():
    torch.manual_seed(1)
    base = Linear4bit.from_linear(fp_linear(), "nf4")
    model = LoRA(base, rank=4)
    # a target the adapter can reach: the frozen weight plus a rank-2 change
    delta = torch.randn(OUT, 2) @ torch.randn(2, IN) * 0.3
    teacher_weight = dequantized(base) + delta
    x = torch.randn(256, IN)
    target = F.linear(x, teacher_weight, base.bias.detach())
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["base.bias", "A.weight", "B.weight"]
    base.bias.requires_grad_(False)
    losses = []
    for _ in range(50):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses[::10]
    assert base.weight.grad is None


def test_gradient_reaches_the_embedding_of_a_quantized_model():
    model = TinyLM(layers=1)
    quantize_model(model, "nf4", progress=False)
    model(torch.randint(0, 100, (2, 6))).logsumexp(-1).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert all(m.weight.grad is None for m in model.modules() if isinstance(m, Linear4bit))


# -- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_move_quantizes_there_and_moves_the_state():
    source = fp_linear()
    layer = Linear4bit(IN, OUT, quant_type="nf4")
    layer.load_state_dict(source.state_dict())
    layer.cuda()
    assert layer.weight.is_cuda and layer.weight.quant_state.absmax.is_cuda
    x = torch.randn(3, IN, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x, dequantized(layer).bfloat16(), layer.bias.bfloat16())
    torch.testing.assert_close(layer(x), expected, rtol=2e-2, atol=2e-2)
    layer.cpu()
    assert not layer.weight.is_cuda and not layer.weight.quant_state.absmax.is_cuda
    assert not layer.weight.quant_state.state2.absmax.is_cuda


@pytest.mark.gpu
def test_quantize_model_onto_the_gpu():
    model = TinyLM().eval()
    ids = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        reference = model(ids)
    report = quantize_model(model, "nf4", device="cuda", progress=False)
    assert report.backend in ("cuda", "rocm") and report.active_memory_after > report.active_memory_before
    model.to("cuda")
    with torch.no_grad():
        out = model(ids.cuda()).cpu()
    assert (out - reference).norm() / reference.norm() < 0.1


@pytest.mark.gpu
def test_a_dropped_gpu_model_gives_its_memory_back_at_once():
    def run_one():
        model = TinyLM().eval()
        quantize_model(model, "nf4", device="cuda", progress=False)
        with torch.no_grad():
            model.to("cuda")(torch.randint(0, 100, (2, 8), device="cuda"))
        return model

    run_one()  # a first model makes the per-device tables and buffers kept for the process
    gc.collect()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        model = run_one()
        assert torch.cuda.memory_allocated() > before
        del model
        assert torch.cuda.memory_allocated() == before  # no gc.collect(): nothing held by a reference cycle
    finally:
        gc.enable()
