"""bitsandbytes checkpoints, both ways (issue 23, part 2), with real transformers + bitsandbytes on the CPU.

- A tiny random Llama quantized by transformers + bitsandbytes (``BitsAndBytesConfig``: nf4 double-quant, fp4,
  8-bit) and saved loads into the engine's model as stored: ``Linear4bit`` / ``Linear8bitLt`` holding the file's
  packed bytes, the fused q/k/v and gate/up dequantizing to bitsandbytes' own q, k, v..., logits close to
  transformers' for the same quantized model.
- ``anygpu.nn.save_quantized`` on a transformers model quantized by ``anygpu.nn.quantize_model`` writes a folder
  transformers + bitsandbytes load (same logits as ours), and the engine too; ``anygpu generate`` runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

from safetensors import safe_open  # noqa: E402

from anygpu.models import HFCheckpoint  # noqa: E402
from anygpu.models.registry import build_model  # noqa: E402
from anygpu.nn import Linear4bit, Linear8bitLt, quantize_model, save_quantized  # noqa: E402

from .test_models_llama import full_logits  # noqa: E402

IDS = [1, 5, 9, 33, 70, 2, 101, 64, 17, 3, 88, 120]
QUANT = {
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype=torch.float32),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
}


def tiny_config(**extra):
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)
    return transformers.LlamaConfig(**(fields | extra))


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config()).eval()
    folder = tmp_path_factory.mktemp("tiny-fp32")
    model.save_pretrained(folder)
    return folder


def hf_quantized(folder, kind):
    q = transformers.BitsAndBytesConfig(**QUANT[kind])
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, device_map="cpu",
                                                             dtype=torch.float32).eval()


def hf_logits(model, ids=IDS):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def dequantized_twin(hf, float_folder):
    """transformers' model in fp32 with bitsandbytes' own dequantization of every quantized weight: the oracle for
    our logits (bitsandbytes' CPU matmuls compute in 16 bits, ours in fp32).  Built before the model's first forward:
    on a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for its bf16 kernel on the first call."""
    twin = transformers.AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    linears = dict(twin.named_modules())
    for name, module in hf.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            w = bnb.functional.int8_vectorwise_dequant(module.weight.data, module.weight.SCB)
        else:
            continue
        linears[name].weight.data.copy_(w)
    return twin


def ours(folder):
    ckpt = HFCheckpoint(folder)
    return build_model(ckpt.config, ckpt.weights(progress=False), progress=False)


@pytest.mark.parametrize("kind", list(QUANT))
def test_transformers_checkpoint_loads_as_stored(float_folder, tmp_path, kind):
    hf = hf_quantized(float_folder, kind)
    hf.save_pretrained(tmp_path)
    model = ours(tmp_path)
    layer = model.layers[1]
    cls = Linear8bitLt if kind == "int8" else Linear4bit
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert type(linear) is cls
    assert type(model.lm_head) is torch.nn.Linear  # transformers keeps the head in full precision
    with safe_open(tmp_path / "model.safetensors", "pt") as f:  # the stored bytes, not a re-quantization
        stored = f.get_tensor("model.layers.1.self_attn.o_proj.weight")
    assert torch.equal(layer.self_attn.o_proj.weight.data, stored)
    # the fused q/k/v is bitsandbytes' q, k and v, stacked
    attn = hf.model.layers[1].self_attn
    if kind == "int8":
        want = torch.cat([attn.q_proj.weight.data, attn.k_proj.weight.data, attn.v_proj.weight.data])
        assert torch.equal(layer.self_attn.qkv_proj.weight.data, want)
    else:
        want = torch.cat([bnb.functional.dequantize_4bit(p.weight.data, p.weight.quant_state)
                          for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        torch.testing.assert_close(layer.self_attn.qkv_proj.dequantize(torch.float32), want, atol=1e-6, rtol=0)
    got = full_logits(model, IDS)
    if kind != "int8":  # LLM.int8() quantizes the activations too: no fp32 twin computes what it does
        torch.testing.assert_close(got, hf_logits(dequantized_twin(hf, float_folder)), atol=2e-4, rtol=1e-4)
    # bitsandbytes' own CPU forward computes in bf16 (4-bit, AVX512-BF16 CPUs) or casts activations to fp16 (int8)
    ref = hf_logits(hf)
    torch.testing.assert_close(got, ref, atol=5e-3, rtol=0)  # logits up to 0.5


SAVE = {"nf4": ("nf4", {}), "fp4-plain": ("fp4", dict(compress_statistics=False)),
        "int8": ("int8", dict(threshold=6.0))}


def anygpu_quantized(float_folder, kind):
    quant_type, options = SAVE[kind]
    model = transformers.LlamaForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    quantize_model(model, quant_type, progress=False, **options)
    return model


def write_tokenizer(folder, vocab: int = 128):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("kind", list(SAVE))
def test_save_quantized_loads_in_transformers_and_anygpu(float_folder, tmp_path, kind):
    model = anygpu_quantized(float_folder, kind)
    assert save_quantized(model, tmp_path) == tmp_path
    # config.json says what transformers' own BitsAndBytesConfig would
    quant_type, options = SAVE[kind]
    if kind == "int8":
        bnb_config = transformers.BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])
    else:
        bnb_config = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.float32,
            bnb_4bit_use_double_quant=options.get("compress_statistics", True), llm_int8_skip_modules=["lm_head"])
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved == json.loads(bnb_config.to_json_string(use_diff=False))
    ref = hf_logits(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu").eval()
    layer_cls = bnb.nn.Linear8bitLt if kind == "int8" else bnb.nn.Linear4bit
    assert type(hf.model.layers[0].mlp.down_proj) is layer_cls
    torch.testing.assert_close(hf_logits(hf), ref, atol=5e-3, rtol=0)  # bitsandbytes' 16-bit CPU math
    engine_model = ours(tmp_path)
    torch.testing.assert_close(full_logits(engine_model, IDS), ref, atol=1e-5, rtol=1e-5)


def test_generate_cli_runs_a_saved_folder(float_folder, tmp_path):
    save_quantized(anygpu_quantized(float_folder, "nf4"), tmp_path)
    write_tokenizer(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "anygpu.cli", "generate", "--model", str(tmp_path), "--raw",
                           "--max-tokens", "5", "w5 w9 w33"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"model={tmp_path.name}" in proc.stderr and "generated_tokens=" in proc.stderr


def test_errors_name_the_field(float_folder, tmp_path):
    save_quantized(anygpu_quantized(float_folder, "nf4"), tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    with pytest.raises(ValueError, match=r"quantize: the checkpoint is already quantized by bitsandbytes \(4-bit\)"):
        build_model(ckpt.config, ckpt.weights(progress=False), quantize="nf4", progress=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: quantization_config\.quant_method: 'gptq' checkpoints are "
                                         r"not supported"):
        HFCheckpoint(tmp_path)
    with pytest.raises(ValueError, match="no Linear4bit or Linear8bitLt layer: quantize it first"):
        save_quantized(transformers.LlamaForCausalLM(tiny_config()), tmp_path / "plain")
    with pytest.raises(ValueError, match="expected a transformers model"):
        save_quantized(ours(float_folder), tmp_path / "engine")


def _rewrite(folder, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_bad_files_are_named(float_folder, tmp_path):
    from anygpu.models.parallel import TensorParallel

    four, eight = tmp_path / "four", tmp_path / "eight"
    save_quantized(anygpu_quantized(float_folder, "nf4"), four)
    save_quantized(anygpu_quantized(float_folder, "int8"), eight)
    ckpt = HFCheckpoint(four)
    with pytest.raises(ValueError, match="tp: bitsandbytes checkpoints run on one device"):
        build_model(ckpt.config, ckpt.weights(progress=False), tp=TensorParallel(0, 2), progress=False)
    _rewrite(four, lambda t: t.pop("model.layers.1.mlp.up_proj.weight.absmax"))
    with pytest.raises(ValueError, match=rf"{four}: 1 layer\(s\) incomplete, e.g. layers\.1\.mlp\.gate_up_proj: "
                                         r"missing up_proj\.weight\.absmax"):
        ours(four)
    bad_format = {"model.layers.0.mlp.down_proj.weight_format": torch.tensor(1, dtype=torch.uint8)}
    _rewrite(eight, lambda t: t.update(bad_format))
    with pytest.raises(ValueError, match=rf"{eight}: model\.layers\.0\.mlp\.down_proj\.weight_format: expected "
                                         r"weight_format 0"):
        ours(eight)
    config = json.loads((four / "config.json").read_text())
    config["intermediate_size"] = 96
    (four / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"holds 4096 bytes of packed 4-bit weights, but config\.json gives it shape "
                                         r"\((96, 64|64, 96)\)"):
        HFCheckpoint(four)


def test_qwen2_biases_and_tied_embeddings(tmp_path):
    """q/k/v biases land in the fused layer's bias; a tied head is the (full-precision) embedding."""
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(2)
    transformers.Qwen2ForCausalLM(cfg).eval().save_pretrained(tmp_path / "fp")
    hf = hf_quantized(tmp_path / "fp", "nf4-double")
    hf.save_pretrained(tmp_path / "q")
    model = ours(tmp_path / "q")
    assert model.lm_head.weight is model.embed_tokens.weight
    qkv = model.layers[0].self_attn.qkv_proj
    assert type(qkv) is Linear4bit and qkv.bias is not None
    twin = dequantized_twin(hf, tmp_path / "fp")
    torch.testing.assert_close(full_logits(model, IDS), hf_logits(twin), atol=2e-4, rtol=1e-4)


def test_save_quantized_tied_embeddings(tmp_path):
    """A tied head is stored once (as the embedding), and both loaders tie it back."""
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(tiny_config(tie_word_embeddings=True)).eval()
    quantize_model(model, "nf4", progress=False)
    save_quantized(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    ref = hf_logits(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu").eval()
    torch.testing.assert_close(hf_logits(hf), ref, atol=5e-3, rtol=0)
    engine_model = ours(tmp_path)
    assert engine_model.lm_head.weight is engine_model.embed_tokens.weight
    torch.testing.assert_close(full_logits(engine_model, IDS), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_projection_kept_in_full_precision(float_folder, tmp_path, kind):
    """llm_int8_skip_modules naming v_proj: q and k are quantized, v is not, and they run as one fused layer,
    which then runs in full precision (q and k dequantized as bitsandbytes does); the MLP stays quantized."""
    q = transformers.BitsAndBytesConfig(**QUANT[kind], llm_int8_skip_modules=["lm_head", "v_proj"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(float_folder, quantization_config=q, device_map="cpu",
                                                           dtype=torch.float32).eval()
    assert type(hf.model.layers[0].self_attn.v_proj) is torch.nn.Linear
    hf.save_pretrained(tmp_path)
    model = ours(tmp_path)
    assert type(model.layers[0].self_attn.qkv_proj) is torch.nn.Linear
    assert type(model.layers[0].mlp.gate_up_proj) is (Linear8bitLt if kind == "int8" else Linear4bit)
    twin = dequantized_twin(hf, float_folder)
    torch.testing.assert_close(model.layers[0].self_attn.qkv_proj.weight.data,
                               torch.cat([twin.model.layers[0].self_attn.q_proj.weight.data,
                                          twin.model.layers[0].self_attn.k_proj.weight.data,
                                          twin.model.layers[0].self_attn.v_proj.weight.data]), atol=0, rtol=0)
    if kind != "int8":
        torch.testing.assert_close(full_logits(model, IDS), hf_logits(twin), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_save_pretrained_without_quantization_config(float_folder, tmp_path, kind):
    """quantize_model then transformers' own save_pretrained writes the bitsandbytes tensors but no
    quantization_config: the engine still sees what they are and loads them as stored."""
    model = anygpu_quantized(float_folder, kind)
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.config.quantization.bits == (8 if kind == "int8" else 4)
    engine_model = ours(tmp_path)
    assert type(engine_model.layers[0].mlp.down_proj) is (Linear8bitLt if kind == "int8" else Linear4bit)
    torch.testing.assert_close(full_logits(engine_model, IDS), hf_logits(model), atol=1e-5, rtol=1e-5)
