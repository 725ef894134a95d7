"""LoRA through real PEFT on anygpu's 4-bit and int8 layers: training on the CPU, then ``merge_and_unload``.

Oracles: the unmerged PEFT model (what the merge must reproduce) and the dequantized-merge reference, an
unquantized copy whose weights are ``dequantize(W) + B @ A * scaling`` -- it must match the unmerged model to
float rounding (the delta PEFT merges is the one it trained), and the merged model may differ from it only by
one requantization: each weight within half the code's widest gap times its block's absmax (4-bit) or half a
step of its row's scale (int8), and the merged outputs closer to the unmerged ones than the un-adapted base.
"""

import copy

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

from anygpu.integrations.peft import lora_classes, register_lora  # noqa: E402
from anygpu.nn import Linear4bit, Linear8bitLt, quantize_model  # noqa: E402

LAYERS = ("0", "2")


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def _peft_model(quant_type: str):
    model = _model(0)
    quantize_model(model, quant_type, progress=False)
    config = register_lora(peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(LAYERS), lora_dropout=0.0))
    return peft.get_peft_model(model, config)


def _train(model, steps: int = 30) -> list[float]:
    torch.manual_seed(1)
    x = torch.randn(256, 64)
    target = _model(7)(x).detach()  # another network's function: a real fit, not a no-op
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _reference(peft_model, with_delta: bool = True) -> nn.Sequential:
    """Unquantized layers holding dequantize(W) + delta (or dequantize(W) alone), in fp32."""
    ref = _model(0)
    for name in LAYERS:
        lora = peft_model.base_model.model.get_submodule(name)
        layer = ref.get_submodule(name)
        delta = lora.get_delta_weight("default") if with_delta else 0
        layer.weight.data = lora.get_base_layer().dequantize(torch.float32) + delta
        layer.bias.data = lora.get_base_layer().bias.detach().float().clone()
    return ref


@pytest.mark.parametrize("quant_type", ["nf4", "fp4", "int8"])
def test_lora_trains_then_merges_within_the_requantization_error(quant_type):
    model = _peft_model(quant_type)
    cls = Linear8bitLt if quant_type == "int8" else Linear4bit
    for name in LAYERS:
        assert type(model.base_model.model.get_submodule(name)) is lora_classes()[cls]
    losses = _train(model)
    assert losses[-1] < 0.7 * losses[0], losses

    x = torch.randn(32, 64)
    with torch.no_grad():
        unmerged = model(x)
        with model.disable_adapter():
            base = model(x)
    ref = _reference(model)
    with torch.no_grad():
        reference = ref(x)
        # what the quantized matmul itself adds to F.linear(x, dequantize(W)): none for 4-bit on the CPU, the
        # activations' int8 rounding for LLM.int8()
        matmul_error = (base - _reference(model, with_delta=False)(x)).abs().max().item()
    assert (reference - unmerged).abs().max() <= 2 * matmul_error + 1e-4

    deltas = {name: model.base_model.model.get_submodule(name).get_delta_weight("default").detach() for name in LAYERS}
    merged = model.merge_and_unload()
    for name in LAYERS:
        layer = merged.get_submodule(name)
        assert type(layer) is cls  # anygpu's layer again, quantized
        target = ref.get_submodule(name).weight.detach()
        error = (layer.dequantize(torch.float32) - target).abs()
        if quant_type == "int8":
            bound = layer.weight.SCB.float().unsqueeze(1) / 127 * 0.5 + target.abs() * 1e-3  # fp16 rounding
        else:
            state = layer.weight.quant_state
            codes = state.code.float().sort().values
            half_gap = (codes[1:] - codes[:-1]).max() / 2
            blocks = target.reshape(-1, state.blocksize).abs().amax(1)
            # half a grid step of the block's scale, plus the nested (8-bit) absmax's own relative rounding
            bound = (blocks * (half_gap + 0.02) + 1e-6).repeat_interleave(state.blocksize).reshape(target.shape)
        assert (error <= bound).all(), (error - bound).max()
        # the merge did something: the requantized weight is nearer the target than the old weight is
        assert error.norm() < deltas[name].norm()
    with torch.no_grad():
        out = merged(x)
    assert (out - unmerged).norm() < 0.5 * (base - unmerged).norm()


def test_unmerge_restores_the_adapter_free_weight_within_the_requantization_error():
    model = _peft_model("nf4")
    _train(model, steps=10)
    lora = model.base_model.model.get_submodule("0")
    base = lora.get_base_layer()
    before = base.dequantize(torch.float32)
    lora.merge()
    assert lora.merged
    merged = base.dequantize(torch.float32)
    lora.unmerge()
    assert not lora.merged
    after = base.dequantize(torch.float32)
    state = base.weight.quant_state
    codes = state.code.float().sort().values
    half_gap = (codes[1:] - codes[:-1]).max() / 2
    def scale(w):  # each element's block maximum
        return w.reshape(-1, state.blocksize).abs().amax(1).repeat_interleave(state.blocksize)

    # two requantizations (of before + delta, then of merged - delta), each within half a grid step of its
    # block's scale plus the nested absmax's rounding; the 1.1 covers a block maximum moved by the first one
    bound = 1.1 * (scale(merged) + scale(after)) * (half_gap + 0.02) + 1e-6
    assert ((after - before).abs().reshape(-1) <= bound).all()
    assert (after - before).norm() < (merged - before).norm()  # the delta was taken out again


def test_without_registration_peft_treats_the_layer_as_nn_linear_and_cannot_merge():
    """Why register_lora exists: PEFT's generic route trains but cannot merge into packed bytes."""
    model = _model(0)
    quantize_model(model, "nf4", progress=False)
    plain = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(LAYERS)))
    assert not isinstance(plain.base_model.model.get_submodule("0"), tuple(lora_classes().values()))
    with pytest.raises(RuntimeError):
        plain.merge_and_unload()


def test_register_lora_rejects_other_configs():
    with pytest.raises(ValueError, match="config"):
        register_lora({"r": 8})


def test_merged_model_saves_and_loads_as_anygpu_layers():
    model = _peft_model("nf4")
    _train(model, steps=5)
    merged = model.merge_and_unload()
    x = torch.randn(4, 64)
    fresh = _model(3)
    quantize_model(fresh, "nf4", progress=False)
    fresh.load_state_dict(copy.deepcopy(merged.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), merged(x))


def test_tiny_llama_qlora_trains_and_merges():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    report = quantize_model(model, "nf4", progress=False)  # every nn.Linear but lm_head
    assert type(model.model.layers[0].self_attn.q_proj) is Linear4bit, report
    lora = register_lora(peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                         lora_dropout=0.0, task_type="CAUSAL_LM"))
    model = peft.get_peft_model(model, lora)
    ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(25):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses  # from ln(128): it learns the sequences
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    merged = model.merge_and_unload()
    assert type(merged.model.layers[1].mlp.down_proj) is Linear4bit
    with torch.no_grad():
        out = merged(input_ids=ids).logits
    assert (out - unmerged).norm() < 0.5 * (base - unmerged).norm()
