"""The engine's ``quantize="q4_0" | "q4_k" | "q8_0"`` on the CPU (``anygpu/models/quantize_packed.py``): packed
``GGUFLinear`` layers built from the quantizers' own GGUF bytes, within the GGUF file path's accuracy of the
unpacked layers (``quantize_model``'s, whose dequantization test_gguf_4bit.py / test_gguf_8bit_layer.py hold to
gguf-py); q4_k's fallback as ``quantize_model`` decides; ``ANYGPU_CPU_GGUF_PACKED=0`` and GPUs keep those layers."""

import pytest
import torch

from anygpu.bench.model import random_config
from anygpu.models.quantize_packed import pack_linear, packed_types
from anygpu.models.registry import build_model
from anygpu.nn.linear_gguf import GGUFLinear
from anygpu.nn.linear_gguf_4bit import GGUF4bitLinear
from anygpu.nn.linear_gguf_8bit import GGUF8bitLinear
from anygpu.nn.quantize_model import quantize_model

from .test_models_llama import full_logits


def _layers(model) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if "Linear" in type(m).__name__}


@pytest.mark.parametrize("quant_type", ["q4_0", "q4_k", "q8_0"])
def test_cpu_build_is_packed_and_close_to_the_unpacked_layers(quant_type, monkeypatch):
    config = random_config("tiny")
    monkeypatch.setenv("ANYGPU_CPU_GGUF_PACKED", "1")  # the suite turns it off (conftest.py); a user's default
    packed = build_model(config, "random", progress=False, quantize=quant_type)
    kinds = _layers(packed)
    assert kinds.pop("lm_head") is torch.nn.Linear and set(kinds.values()) == {GGUFLinear}
    monkeypatch.setenv("ANYGPU_CPU_GGUF_PACKED", "0")
    plain = build_model(config, "random", progress=False, quantize=quant_type)
    assert set(_layers(plain).values()) == {torch.nn.Linear, GGUF8bitLinear if quant_type == "q8_0" else GGUF4bitLinear}
    got, want = full_logits(packed, [1, 5, 9, 3]), full_logits(plain, [1, 5, 9, 3])
    # the packed layout keeps scales in bf16 (gguf_int4pack): about 2**-8 of a logit's size, not more
    assert (got - want).abs().max() <= 2 ** -8 * want.abs().max()


def test_q4_k_falls_back_and_odd_rows_are_left_to_quantize_model():
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(96, 32), torch.nn.Linear(256, 40))
    with pytest.warns(UserWarning, match="1 layer in q8_0 instead of q4_k"):
        packed, left = packed_types(model, "q4_k")
    assert packed == {"0": "q4_k", "1": "q8_0"} and left == ["2"]  # layer 2: 40 rows, not the layout's multiple of 16
    for name, kind in packed.items():
        model[int(name)] = pack_linear(model[int(name)], kind)
    assert isinstance(model[0], GGUFLinear) and isinstance(model[1], GGUFLinear)
    quantize_model(model, "q4_k", progress=False)  # the rest: only layer 2 is an nn.Linear still
    assert isinstance(model[2], GGUF4bitLinear)
    x = torch.randn(3, 256)
    assert model[0](x).shape == (3, 64) and model[2](x).isfinite().all()
