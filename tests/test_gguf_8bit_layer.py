"""``GGUF8bitLinear`` (GGUF's 5/6/8-bit blocks kept as int8 codes + fp32 scales): the layer against F.linear with
gguf-py's dequantized weight, ``quantize_model(model, "q8_0")`` and the bench's choice of it, and bad arguments."""

import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from anygpu.nn.linear_gguf_8bit import GGUF8bitLinear  # noqa: E402
from anygpu.quant import gguf_8bit  # noqa: E402

from .test_gguf_8bit import gguf_values, random_blocks  # noqa: E402


def gguf_q8_0(w: torch.Tensor) -> torch.Tensor:
    raw = gguf.quants.quantize(w.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return gguf_values(raw, "Q8_0", *w.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_from_linear_equals_linear_with_the_gguf_dequantized_weight(dtype):
    linear = torch.nn.Linear(256, 48)
    layer = GGUF8bitLinear.from_linear(linear, "Q8_0")
    w = gguf_q8_0(linear.weight)
    assert torch.equal(layer.dequantize(), w)
    x = torch.randn(3, 256).to(dtype)
    want = F.linear(x.float(), w, linear.bias.detach())
    torch.testing.assert_close(layer(x).float(), want, **({} if dtype == torch.float32 else
                                                           {"atol": 0.02 * want.abs().max().item(), "rtol": 0}))
    assert [n for n, _ in layer.named_parameters()] == ["bias"]  # the weight is buffers
    assert sorted(n for n, _ in layer.named_buffers()) == ["codes", "scale"]
    assert "blocksize=32, offset=False, bias=True" in repr(layer)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_K", "Q5_0", "Q5_1"])
def test_layer_from_file_blocks(type_name):
    raw = random_blocks(type_name, 40, 256, seed=5)
    layer = GGUF8bitLinear(gguf_8bit.convert(torch.from_numpy(raw).reshape(-1), type_name, 40, 256), 256, 40)
    w = gguf_values(raw, type_name, 40, 256)
    assert torch.equal(layer.dequantize(), w)
    x = torch.randn(2, 7, 256)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert (layer.offset is not None) == (type_name in ("Q5_K", "Q5_1"))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K"])
def test_from_linear_in_16_bits_keeps_fp16_scales(type_name):
    """A bf16 layer's scales in fp16 (``gguf_8bit.narrow``): half the scale bytes, every weight within 2^-11 of
    its block's magnitude of gguf-py's value (Q8_0: exact, its d is an fp16)."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(512, 32, bias=False).to(torch.bfloat16)
    layer = GGUF8bitLinear.from_linear(linear, type_name)
    assert layer.scale.dtype == torch.float16 and layer.offset is None
    quantize = gguf_8bit.quantize_q8_0 if type_name == "Q8_0" else gguf_8bit.quantize_q6_k
    want = gguf_values(quantize(linear.weight.detach()).numpy(), type_name, 32, 512)
    got = layer.dequantize()
    q = layer.codes.reshape(-1, layer.blocksize).abs().amax(dim=1).float() * layer.scale.float().abs()
    assert bool(((got - want).abs() <= (2.0 ** -11 * q).repeat_interleave(layer.blocksize).reshape(32, 512)).all())
    if type_name == "Q8_0":
        assert torch.equal(got, want)
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, got.bfloat16()), rtol=0, atol=0)


# (quantizing in slices of rows: tests/test_row_slices.py)


def test_bad_layer_arguments_name_them():
    with pytest.raises(ValueError, match="type_name: expected one of \\('Q8_0', 'Q6_K'\\)"):
        GGUF8bitLinear.from_linear(torch.nn.Linear(64, 4), "Q5_K")
    with pytest.raises(ValueError, match="linear: Q6_K needs in_features a multiple of 256, got 64"):
        GGUF8bitLinear.from_linear(torch.nn.Linear(64, 4), "Q6_K")
    with pytest.raises(ValueError, match="linear: Q8_0 needs in_features a multiple of 32, got 40"):
        GGUF8bitLinear.from_linear(torch.nn.Linear(40, 4), "Q8_0")
    w = gguf_8bit.convert(gguf_8bit.quantize_q8_0(torch.randn(4, 64)).reshape(-1), "Q8_0", 4, 64)
    with pytest.raises(ValueError, match=r"weight: expected int8 codes of shape \(5, 64\)"):
        GGUF8bitLinear(w, 64, 5)
    with pytest.raises(ValueError, match=r"weight: expected the scale as float32 or float16 \(both alike\) of "
                                         r"shape \(8,\)"):
        GGUF8bitLinear(w._replace(scale=w.scale[:-1]), 64, 4)
    with pytest.raises(ValueError, match=r"weight: expected the offset as float32 or float16 \(both alike\)"):
        GGUF8bitLinear(w._replace(scale=w.scale.half(), offset=w.scale), 64, 4)
    with pytest.raises(ValueError, match="weight: expected a block of 16 or 32"):
        GGUF8bitLinear(w._replace(blocksize=64), 64, 4)


def test_quantize_model_to_q8_0():
    """What ``anygpu bench model --quantize q8_0`` builds: the bench's tiny random Llama with every projection (not
    the head) in Q8_0 blocks, each layer gguf-py's dequantization of gguf-py's own quantization."""
    from anygpu.bench.model import random_config
    from anygpu.models.registry import QUANT_TYPES, build_model
    from anygpu.nn import quantize_model

    from .test_models_llama import full_logits

    assert "q8_0" in QUANT_TYPES
    config = random_config("tiny")
    model = build_model(config, "random", progress=False)
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    report = quantize_model(model, "q8_0", progress=False)
    assert sorted(report.replaced) == sorted(weights) and report.skipped == ["lm_head"]
    assert report.parameter_bytes_after < report.parameter_bytes_before
    for name, w in weights.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, GGUF8bitLinear)
        assert torch.equal(layer.dequantize(), gguf_q8_0(w)), name
    assert full_logits(model, [1, 5, 9]).isfinite().all()
    built = build_model(config, "random", progress=False, quantize="q8_0")
    assert isinstance(built.layers[0].mlp.down_proj, GGUF8bitLinear)
    with pytest.raises(ValueError, match="threshold: not used by quant_type='q8_0'"):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 8)), "q8_0", threshold=6.0)
    with pytest.raises(ValueError, match="model: q8_0 needs in_features a multiple of 32"):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(40, 8)), "q8_0")


def test_gguf_types_give_the_head_llama_cpp_s_type():
    """``head_type``: the head as llama.cpp's mixes store it (Q6_K below Q8_0; Q8_0 where a row is not whole
    256-blocks); a tied head and a CPU build (``build_model``) keep theirs."""
    from anygpu.bench.model import random_config
    from anygpu.models.quantize_at_load import GGUF_HEAD_TYPES, head_type
    from anygpu.models.registry import build_model

    from .test_models_llama import full_logits

    assert GGUF_HEAD_TYPES == {"q4_0": "Q6_K", "q4_k": "Q6_K", "q8_0": "Q8_0"}
    config = random_config("tiny")
    assert not config.tie_word_embeddings and config.hidden_size % 256 == 0
    model = build_model(config, "random", progress=False, quantize="q4_k")
    assert type(model.lm_head) is torch.nn.Linear  # built on the CPU: the head stays
    w = model.lm_head.weight.detach().clone()
    before = full_logits(model, [1, 5, 9])
    assert head_type(model, "Q6_K") == "Q6_K"
    model.lm_head = GGUF8bitLinear.from_linear(model.lm_head, "Q6_K")
    head = model.lm_head
    assert isinstance(head, GGUF8bitLinear) and head.blocksize == 16 and head.scale.dtype == torch.float32
    assert torch.equal(head.dequantize(), gguf_values(gguf_8bit.quantize_q6_k(w).numpy(), "Q6_K", *w.shape))
    after = full_logits(model, [1, 5, 9])
    assert after.isfinite().all() and (after - before).abs().max() < 0.05 * before.abs().max()

    narrow = torch.nn.Module()  # a 288-wide head: not whole 256-blocks, so Q8_0
    narrow.embed_tokens, narrow.lm_head = torch.nn.Embedding(8, 288), torch.nn.Linear(288, 8, bias=False)
    assert head_type(narrow, "Q6_K") == "Q8_0"
    assert GGUF8bitLinear.from_linear(narrow.lm_head, "Q8_0").blocksize == 32
    tied = torch.nn.Module()
    tied.embed_tokens, tied.lm_head = torch.nn.Embedding(8, 256), torch.nn.Linear(256, 8, bias=False)
    tied.lm_head.weight = tied.embed_tokens.weight
    assert head_type(tied, "Q6_K") is None


def test_bench_takes_q8_0():
    from anygpu.cli.bench_model import parse_quantize

    assert parse_quantize("bf16,q8_0") == [None, "q8_0"]
