"""GGUF 4-bit projections kept packed for the GPU (``gguf_packed.pack_4bit`` -> ``GGUF4bitLinear``), run here on the
CPU (the op's reference; the kernels are tests/test_matmul_4bit_offset.py's): a tiny Llama whose tensors mix Q4_0,
Q4_1, Q4_K and Q8_0 loads with the 4-bit projections packed, the others as GGUF8bitLinear
(tests/test_gguf_gpu_packed_8bit.py), and gives the logits of the fully dequantized model; the layer equals F.linear
with gguf-py's dequantized weight."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from ._gguf_writer import BYTE_VOCAB, add_byte_vocab, gguf_metadata, gguf_tensors  # noqa: E402
from .test_models_llama import full_logits, greedy  # noqa: E402

from anygpu.models import GGUFCheckpoint, gguf_packed  # noqa: E402
from anygpu.models.registry import build_model  # noqa: E402
from anygpu.nn.linear_gguf_4bit import GGUF4bitLinear  # noqa: E402
from anygpu.nn.linear_gguf_8bit import GGUF8bitLinear  # noqa: E402
from anygpu.quant import gguf_4bit  # noqa: E402

# GGUF tensor -> type (the rest of the matrices Q8_0, which GGUF8bitLinear takes)
TYPES = {"blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K",  # v Q8_0: qkv mixed, a GGUF8bitLinear
         "blk.0.attn_output": "Q4_0", "blk.0.ffn_gate": "Q4_K", "blk.0.ffn_up": "Q4_0", "blk.0.ffn_down": "Q4_1",
         "blk.1.attn_q": "Q4_0", "blk.1.attn_k": "Q4_0", "blk.1.attn_v": "Q4_0", "blk.1.attn_output": "Q4_1",
         "blk.1.ffn_gate": "Q4_K", "blk.1.ffn_up": "Q4_K", "blk.1.ffn_down": "Q4_K"}


def quantized(array: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "Q4_K":  # gguf-py has no Q4_K quantizer
        return gguf_4bit.quantize_q4_k(torch.from_numpy(array)).numpy()
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[type_name])


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(config).eval()
    path = str(tmp_path_factory.mktemp("gguf4") / "mixed.gguf")
    w = gguf.GGUFWriter(path, "llama")
    types = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
             str: gguf.GGUFValueType.STRING}
    for key, value in gguf_metadata("llama", config).items():
        w.add_key_value(f"llama.{key}", value, types[type(value)])
    add_byte_vocab(w)
    for name, array in gguf_tensors("llama", hf).items():
        array = np.ascontiguousarray(array)
        if array.ndim != 2:
            w.add_tensor(name, array)
            continue
        type_name = TYPES.get(name.removesuffix(".weight"), "Q8_0")
        w.add_tensor(name, quantized(array, type_name), raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_mixed_file_loads_packed_and_gives_the_dequantized_logits(mixed_file):
    ckpt = GGUFCheckpoint(mixed_file)
    reference = build_model(ckpt.config, ckpt.weights(progress=False))  # every tensor dequantized (fp32)
    counts = []
    model = build_model(ckpt.config, ckpt.weights(progress=False, skip=gguf_packed.packed_tensors(ckpt)),
                        prepare=lambda m: counts.append(gguf_packed.pack_4bit(m, ckpt)))
    packed = {name: m for name, m in model.named_modules() if isinstance(m, GGUF4bitLinear)}
    assert sorted(packed) == ["layers.0.mlp.down_proj", "layers.0.mlp.gate_up_proj", "layers.0.self_attn.o_proj",
                              "layers.1.mlp.down_proj", "layers.1.mlp.gate_up_proj", "layers.1.self_attn.o_proj",
                              "layers.1.self_attn.qkv_proj"] and counts == [8]
    assert packed["layers.0.mlp.gate_up_proj"].offset is not None  # Q4_K next to Q4_0: one table, with offsets
    assert packed["layers.1.self_attn.qkv_proj"].offset is None  # Q4_0 alone: no offset
    # qkv with a Q8_0 v goes whole to the int8-block layout (tests/test_gguf_gpu_packed_8bit.py)
    assert isinstance(model.layers[0].self_attn.qkv_proj, GGUF8bitLinear)
    references = dict(reference.named_modules())
    for name, layer in packed.items():  # the file's values (Q4_K's: but for its offset's rounding), q/k in HF's order
        torch.testing.assert_close(layer.dequantize(), references[name].weight, rtol=2.0 ** -22, atol=1e-8, msg=name)
    ids = [256, 72, 101, 108, 108, 111, 44, 32, 119]
    torch.testing.assert_close(full_logits(model, ids), full_logits(reference, ids))


@pytest.mark.gpu
def test_engine_on_a_gpu_keeps_the_4bit_projections_packed(mixed_file, monkeypatch):
    """The engine's own loading on a GPU (one process): the 4-bit projections are GGUF4bitLinear, each within
    bf16's rounding of its dequantized layer on every path of the plan (1 row: GEMV, 4: GEMM where NVIDIA would
    take the MMA path, 16: GEMM, 100: dequantize + vendor GEMM), and greedy decoding runs (CUDA graphs)."""
    from anygpu.engine import LLMEngine
    from anygpu.testing import assert_accurate

    monkeypatch.delenv("ANYGPU_GPU_GGUF_PACKED", raising=False)
    engine = LLMEngine(mixed_file, progress=False, block_size=16, max_model_len=64, device="cuda")
    try:
        packed = {n: m for n, m in engine.model.named_modules() if isinstance(m, GGUF4bitLinear)}
        assert len(packed) == 7 and all(m.packed.is_cuda for m in packed.values())
        ckpt = GGUFCheckpoint(mixed_file)
        reference = dict(build_model(ckpt.config, ckpt.weights(progress=False)).named_modules())
        for name, layer in packed.items():
            w = reference[name].weight.cuda()
            for m in (1, 4, 16, 100):
                x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.bfloat16)
                oracle = F.linear(x.float(), w)
                assert_accurate(layer(x), F.linear(x, w.bfloat16()), oracle, what=f"{name} m={m}")
        assert len(greedy(engine, [256, 72, 101, 108], 8)) == 8
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K"])
def test_layer_equals_linear_with_the_gguf_dequantized_weight(type_name, dtype):
    linear = torch.nn.Linear(256, 48)
    layer = GGUF4bitLinear.from_linear(linear, type_name)
    raw = (gguf_4bit.quantize_q4_0 if type_name == "Q4_0" else gguf_4bit.quantize_q4_k)(linear.weight.detach())
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name]).copy())
    x = torch.randn(3, 256).to(dtype)
    want = F.linear(x.float(), w, linear.bias.detach())
    torch.testing.assert_close(layer(x).float(), want, **({} if dtype == torch.float32 else
                                                           {"atol": 0.02 * want.abs().max().item(), "rtol": 0}))
    assert not list(layer.parameters())[1:] and layer.bias is not None  # the weight is buffers


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K"])
def test_16_bit_layer_keeps_fp16_scales_and_its_accuracy(type_name):
    """A bf16 linear's layer holds fp16 scales and offsets (gguf_4bit.narrow: 0.625 bytes a weight) and stays within
    bf16's accuracy rule of gguf-py's dequantized weight."""
    from anygpu.testing import assert_accurate

    linear = torch.nn.Linear(512, 64).to(torch.bfloat16)
    layer = GGUF4bitLinear.from_linear(linear, type_name)
    assert layer.absmax.dtype == torch.float16 and (layer.offset is None or layer.offset.dtype == torch.float16)
    raw = (gguf_4bit.quantize_q4_0 if type_name == "Q4_0" else gguf_4bit.quantize_q4_k)(linear.weight.detach())
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name]).copy())
    x = torch.randn(5, 512).to(torch.bfloat16)
    bias = linear.bias.detach()
    assert_accurate(layer(x), F.linear(x, w.to(torch.bfloat16), bias), F.linear(x.float(), w, bias.float()),
                    what=type_name)


def test_enabled_on_gpus_unless_turned_off(monkeypatch):
    gpu = torch.device("cuda", 0)
    monkeypatch.delenv("ANYGPU_GPU_GGUF_PACKED", raising=False)
    assert gguf_packed.enabled(gpu) and not gguf_packed.enabled(gpu, tp_world_size=2)
    monkeypatch.setenv("ANYGPU_GPU_GGUF_PACKED", "0")
    assert not gguf_packed.enabled(gpu)


def test_bad_layer_arguments_name_them():
    with pytest.raises(ValueError, match="type_name: expected one of"):
        GGUF4bitLinear.from_linear(torch.nn.Linear(64, 4), "Q6_K")
    w = gguf_4bit.convert(gguf_4bit.quantize_q4_0(torch.randn(4, 64)).reshape(-1), "Q4_0", 4, 64)
    with pytest.raises(ValueError, match="weight: expected 160 packed bytes"):
        GGUF4bitLinear(w, 64, 5)


@pytest.mark.parametrize("quant_type", ["q4_0", "q4_k"])
def test_quantize_model_to_gguf_types(quant_type):
    """What ``anygpu bench model --quantize q4_k`` builds: the bench's tiny random Llama with every projection (not
    the head) in GGUF blocks, each layer equal to F.linear with gguf-py's dequantization of its blocks."""
    from anygpu.bench.model import random_config
    from anygpu.nn import quantize_model

    config = random_config("tiny")
    model = build_model(config, "random", progress=False)
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    report = quantize_model(model, quant_type, progress=False)
    assert sorted(report.replaced) == sorted(weights) and report.skipped == ["lm_head"]
    type_name = quant_type.upper()
    quantize = gguf_4bit.quantize_q4_0 if type_name == "Q4_0" else gguf_4bit.quantize_q4_k
    for name, w in weights.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, GGUF4bitLinear)
        raw = quantize(w).numpy()
        want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy())
        torch.testing.assert_close(layer.dequantize(), want.reshape(w.shape), rtol=2.0 ** -22, atol=1e-12, msg=name)
    assert full_logits(model, [1, 5, 9]).isfinite().all()
    with pytest.raises(ValueError, match="compute_dtype: not used by quant_type='q4_k'"):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(256, 8)), "q4_k", compute_dtype=torch.float16)
    if quant_type == "q4_k":
        # in_features a multiple of 32, not of 256: Q8_0 for that layer, as llama.cpp falls back, said and reported
        mixed = torch.nn.Sequential(torch.nn.Linear(256, 96), torch.nn.Linear(96, 8))
        with pytest.warns(UserWarning, match="1 layer in q8_0 instead of q4_k"):
            report = quantize_model(mixed, "q4_k", progress=False)
        assert report.fallbacks == {"1": "q8_0"} and "q8_0 instead" in str(report)
        assert isinstance(mixed[0], GGUF4bitLinear) and isinstance(mixed[1], GGUF8bitLinear)
        # a layer no block fits: refused before any layer is replaced
        untouched = torch.nn.Sequential(torch.nn.Linear(256, 40), torch.nn.Linear(40, 8))
        with pytest.raises(ValueError, match=r"model: q4_k needs in_features a multiple of 32; .* 1 \(40\)"):
            quantize_model(untouched, "q4_k")
        assert all(type(m) is torch.nn.Linear for m in untouched)
