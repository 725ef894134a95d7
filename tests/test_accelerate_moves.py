"""anygpu's 4-bit layers (``quantize_model``) through real accelerate: its device moves, offload hooks and empty-
weight loading keep each weight's ``quant_state`` and give the same outputs, on the CPU.

accelerate rebuilds a ``Params4bit`` on every move (``param_cls(value, **param.__dict__).to(device)`` in
``set_module_tensor_to_device``) and offloads by moving each weight to ``meta`` between calls, restoring it from
its own copy of the parameter (not of the quant state).  bitsandbytes' Params4bit moves its shared quant state
to meta with the weight and cannot come back (its CPU layers fail these same checks with "Cannot copy out of
meta tensor"); anygpu's gives the meta param a meta copy and takes the layer's state back on the return
(anygpu/nn/params4bit.py).
"""

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate import cpu_offload, dispatch_model, init_empty_weights, load_checkpoint_in_model  # noqa: E402
from accelerate.utils import set_module_tensor_to_device  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from anygpu.nn import Linear4bit, Params4bit, quantize_model  # noqa: E402


class Tiny(nn.Module):
    """Two linears; ``quantized`` builds them as anygpu Linear4bit layers directly (an architecture that is
    quantized by construction, as transformers builds bitsandbytes models under init_empty_weights)."""

    def __init__(self, quantized: bool = False, compress_statistics: bool = True):
        super().__init__()

        def linear(i, o):
            if quantized:
                return Linear4bit(i, o, quant_type="nf4", compress_statistics=compress_statistics)
            return nn.Linear(i, o)

        self.a, self.act, self.b = linear(64, 128), nn.ReLU(), linear(128, 64)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def _tiny(compress_statistics: bool = True) -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    quantize_model(model, "nf4", skip=(), compress_statistics=compress_statistics, progress=False)
    return model


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    quantize_model(model, "nf4", progress=False)
    return model


X = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _assert_intact(layer: Linear4bit) -> None:
    weight = layer.weight
    assert isinstance(weight, Params4bit) and weight.bnb_quantized
    assert weight.quant_state is layer.quant_state is not None
    assert weight.module is layer
    assert weight.quant_state.absmax.device == weight.device


@pytest.mark.parametrize("nested", [True, False])
def test_set_module_tensor_to_device_to_meta_and_back(nested):
    model = _tiny(nested)
    ref = model(X)
    packed, state = model.a.weight.data.clone(), model.a.quant_state
    set_module_tensor_to_device(model, "a.weight", "meta")
    weight = model.a.weight
    assert isinstance(weight, Params4bit) and weight.is_meta and weight.quant_state.absmax.is_meta
    assert model.a.quant_state is state and state.absmax.device.type == "cpu"  # the layer's own stayed
    set_module_tensor_to_device(model, "a.weight", "cpu", value=packed)
    _assert_intact(model.a)
    assert model.a.quant_state is state
    assert torch.equal(model(X), ref)
    set_module_tensor_to_device(model, "b.weight", "cpu")  # a move to where it is already: unchanged
    _assert_intact(model.b)
    assert torch.equal(model(X), ref)


def test_cpu_offload_keeps_the_quant_state():
    model = _llama()
    ref = _logits(model)
    cpu_offload(model, execution_device="cpu")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Linear4bit) and q_proj.weight.is_meta  # offloaded between calls
    for _ in range(2):  # each call brings the weights back from accelerate's copy and offloads them again
        assert torch.equal(_logits(model), ref)
    assert q_proj.weight.is_meta and q_proj.weight.quant_state.absmax.is_meta  # a placeholder, as the bytes
    assert q_proj.quant_state.absmax.device.type == "cpu"  # the layer's own, which the next call takes back


def test_dispatch_model_with_cpu_and_disk_offload(tmp_path):
    model = _llama()
    ref = _logits(model)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(tmp_path))
    assert model.model.layers[1].mlp.up_proj.weight.is_meta
    for _ in range(2):
        assert torch.equal(_logits(model), ref)
    _assert_intact(model.model.layers[0].mlp.up_proj)


@pytest.mark.parametrize("how", ["assign", "to_empty"])
def test_init_empty_weights_then_load_a_quantized_state_dict(how):
    source = _tiny()
    ref, state_dict = source(X), source.state_dict()
    with init_empty_weights():
        model = Tiny(quantized=True)
    assert model.a.weight.is_meta and isinstance(model.a.weight, Params4bit) and model.a.weight.module is model.a
    if how == "assign":
        model.load_state_dict(state_dict, assign=True)
    else:
        model.to_empty(device="cpu")
        model.load_state_dict(state_dict)
    for layer in (model.a, model.b):
        _assert_intact(layer)
    assert torch.equal(model(X), ref)


def test_init_empty_weights_then_accelerate_loads_full_precision_weights(tmp_path):
    """accelerate's own loader sets parameters one by one; full-precision ones are quantized on the way in, as
    quantize_model quantizes them."""
    torch.manual_seed(0)
    plain = Tiny()
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(tmp_path / "model.safetensors"))
    quantize_model(plain, "nf4", skip=(), progress=False)
    with init_empty_weights():
        model = Tiny(quantized=True)
    load_checkpoint_in_model(model, str(tmp_path / "model.safetensors"), device_map={"": "cpu"})
    for layer in (model.a, model.b):
        _assert_intact(layer)
    assert torch.equal(model(X), plain(X))


def test_accelerate_loading_a_packed_checkpoint_is_a_clear_error(tmp_path):
    """accelerate's loader does not know the quant-state keys (it sets parameters only, and casts the packed
    bytes to the empty weight's float dtype): a clear error instead of quantizing the packed column."""
    state_dict = _tiny().state_dict()
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp_path / "model.safetensors"))
    with init_empty_weights():
        model = Tiny(quantized=True)
    with pytest.raises(ValueError, match=r"weight: expected the full-precision \[128, 64\] weight of this Linear4bit"):
        load_checkpoint_in_model(model, str(tmp_path / "model.safetensors"), device_map={"": "cpu"})


def test_chunk_and_split_keep_the_attributes():
    """As bitsandbytes' Params4bit: sharding code that splits a param gets Params4bit pieces; other ops give
    plain tensors."""
    layer = _tiny().a
    weight = layer.weight
    for pieces in (torch.chunk(weight, 2), torch.split(weight, 100), weight.chunk(4), weight.split(1000)):
        assert all(type(p) is Params4bit for p in pieces)
        assert all(p.quant_state is weight.quant_state and p.module is layer and p.bnb_quantized for p in pieces)
        assert torch.equal(torch.cat([p.data for p in pieces]), weight.data)
    assert type(weight + 0) is torch.Tensor and type(weight.view(-1)) is torch.Tensor


def test_a_meta_weight_without_its_layer_cannot_come_back():
    """The move back from meta takes the layer's quant state; a param rebuilt without its layer has none left."""
    weight = _tiny().a.weight.to("meta")
    orphan = Params4bit(torch.zeros(weight.shape, dtype=weight.dtype), **{**weight.__dict__, "module": None})
    with pytest.raises(ValueError, match="quant_state: on the meta device, with no layer holding it"):
        orphan.to("cpu")
