"""GGUF files of the families added after Qwen2 (Qwen3, Gemma 2, Gemma 3, Phi-3) load and run like their HF folders.

Each test builds a tiny random transformers model, saves it as an HF folder (safetensors) and writes the same
weights as a GGUF the way llama.cpp's converter does (``tests/_gguf_writer.py``: the ``gguf`` package's tensor
names, Gemma's norms stored as 1 + w, Phi-3's fused attn_qkv / ffn_up and LongRoPE factor tensors, the metadata
keys the converter writes).  Then, in fp32:
- the config read from the GGUF equals the one read from config.json (but for the eps, stored as a float32, and
  the dtype), and the family's own fields have the expected values;
- our logits from the GGUF equal transformers' own GGUF loading of the same file (``from_pretrained(gguf_file=)``,
  given as keyword arguments the config values its GGUF reader leaves at their defaults: Qwen3's head_dim,
  Gemma's query_pre_attn_scalar and soft-caps, Gemma 3's rope parameters, Phi-3's partial rotary factor, window
  and pad token), and our logits from the HF folder;
- the engine, from the GGUF path, generates transformers' greedy tokens (windows shorter than the sequence).
Phi-3's LongRoPE (rope factor tensors, which transformers' GGUF reader ignores) is checked against our own
safetensors path and transformers' model the file was written from.  Q8_0 files: dequantized at load against
transformers' GGUF loading, and on the CPU's packed path (which projections stay packed, each against its
dequantized layer).  Files of an architecture or with tensors
this loader does not know are refused, naming the file and what is unknown.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anygpu.engine import LLMEngine
from anygpu.models import GGUFCheckpoint, HFCheckpoint, ModelConfig
from anygpu.models.registry import build_model

from ._gguf_writer import BYTE_VOCAB, write_gguf, write_hf_as_gguf
from .test_models_families import our_logits, save_tiny
from .test_models_llama import full_logits, greedy, hf_greedy

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256, eos_token_id=257)
IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101, 32, 99, 97, 116]
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
PHI3_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}


def _family(arch: str):
    """(model class, config, the keyword arguments transformers' GGUF loading needs for what it does not read)."""
    if arch == "qwen3":
        return (transformers.Qwen3ForCausalLM,
                transformers.Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False, rope_theta=1e6),
                {"head_dim": 32})
    # Gemma: llama.cpp scales attention by head_dim ** -0.5 (query_pre_attn_scalar = head_dim), which is not
    # hidden / heads here (as at 27B, where llama.cpp takes that instead)
    if arch == "gemma2":
        caps = {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0}
        return (transformers.Gemma2ForCausalLM,
                transformers.Gemma2Config(**SMALL, head_dim=32, query_pre_attn_scalar=32, sliding_window=6, **caps),
                {"query_pre_attn_scalar": 32, **caps})
    if arch == "gemma3":  # six layers: llama.cpp's Gemma 3 period (five sliding, one global)
        return (transformers.Gemma3ForCausalLM,
                transformers.Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 6}, head_dim=32,
                                              query_pre_attn_scalar=32, sliding_window=6,
                                              rope_parameters=GEMMA3_ROPE),
                {"query_pre_attn_scalar": 32, "rope_parameters": GEMMA3_ROPE})
    assert arch == "phi3"
    return (transformers.Phi3ForCausalLM,
            transformers.Phi3Config(**SMALL, tie_word_embeddings=False, pad_token_id=0, sliding_window=6,
                                    rope_parameters=PHI3_ROPE),
            {"pad_token_id": 0, "rope_parameters": PHI3_ROPE, "sliding_window": 6})


def _same_config(from_gguf: ModelConfig, from_hf: ModelConfig) -> None:
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)  # a float32 in the file
    assert dataclasses.replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps, dtype=from_hf.dtype) == from_hf


def _check_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_gguf_equals_transformers_gguf_loading_and_safetensors(tmp_path_factory, arch):
    cls, config, missing_from_gguf = _family(arch)
    folder, hf = save_tiny(tmp_path_factory, cls, config)
    out = tmp_path_factory.mktemp(f"{arch}-gguf")
    path = write_hf_as_gguf(out / f"{arch}.gguf", hf)
    ckpt = GGUFCheckpoint(path)
    cfg = ckpt.config
    _same_config(cfg, HFCheckpoint(folder).config)
    # the family's fields, as the file says them (and llama.cpp's rules for what it does not say)
    family = cfg.family
    assert cfg.architecture == arch
    assert family.qk_norm == (arch in ("qwen3", "gemma3")) and family.sandwich_norms == arch.startswith("gemma")
    if arch == "qwen3":
        assert (cfg.head_dim, cfg.tie_word_embeddings, cfg.rope_theta, cfg.sliding_window) == (32, False, 1e6, None)
    if arch == "gemma2":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scale, cfg.hidden_act) == (1.0, 3.0, 32 ** -0.5,
                                                                                       "gelu_tanh")
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.tie_word_embeddings) == (6, (True, False), True)
    if arch == "gemma3":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scale) == (None, None, 32 ** -0.5)
        assert (cfg.sliding_window, cfg.sliding_layers) == (6, (True,) * 5 + (False,))
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, {"rope_type": "linear",
                                                                                       "factor": 4.0})
    if arch == "phi3":
        assert (cfg.rotary_dim, cfg.head_dim, cfg.sliding_window, cfg.sliding_layers) == (12, 16, 6, None)
        assert family.fused_checkpoint and cfg.rope_scaling is None
    weights = dict(ckpt.weights(progress=False))
    # HF's own values: Gemma's norms back from llama.cpp's 1 + w, Phi-3's fused tensors whole
    state = hf.state_dict()
    assert set(weights) == set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    for name, w in weights.items():  # Gemma's norms: w + 1 - 1, exact to an ulp of 1
        atol = 2.0 ** -23 if arch.startswith("gemma") and name.endswith("norm.weight") else 0.0
        torch.testing.assert_close(w, state[name], atol=atol, rtol=0, msg=name)

    got = full_logits(build_model(cfg, iter(weights.items())), IDS)
    tf_gguf = cls.from_pretrained(str(out), gguf_file=f"{arch}.gguf", dtype=torch.float32, **missing_from_gguf).eval()
    with torch.inference_mode():
        expected = tf_gguf(torch.tensor([IDS])).logits[0].float()
    _check_close(got, expected)
    hf_ckpt = HFCheckpoint(folder)
    _check_close(got, full_logits(build_model(hf_ckpt.config, hf_ckpt.weights(progress=False)), IDS))

    # the engine from the file, decoding past the window: transformers' greedy tokens
    engine = LLMEngine(path, progress=False, block_size=4, max_model_len=64, device="cpu")
    try:
        assert greedy(engine, IDS[:8], 10) == hf_greedy(tf_gguf, IDS[:8], 10)
    finally:
        engine.close()


def _phi3_longrope(original: int):
    rot = 16 * 3 // 4
    gen = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": original,
            "short_factor": (1 + torch.rand(rot // 2, generator=gen)).tolist(),
            "long_factor": (1 + 8 * torch.rand(rot // 2, generator=gen)).tolist()}
    return transformers.Phi3Config(**{**SMALL, "tie_word_embeddings": True, "pad_token_id": 0,
                                      "rope_parameters": rope, "original_max_position_embeddings": original})


def test_phi3_longrope_gguf_equals_safetensors(tmp_path_factory):
    """rope_factors_long / rope_factors_short and rope.scaling.attn_factor: long factors for contexts past the
    original length (the engine's 256), short ones for a max_model_len within it."""
    original = 24
    folder, hf = save_tiny(tmp_path_factory, transformers.Phi3ForCausalLM, _phi3_longrope(original))
    path = write_hf_as_gguf(tmp_path_factory.mktemp("phi3-longrope") / "phi3.gguf", hf)
    ckpt, hf_ckpt = GGUFCheckpoint(path), HFCheckpoint(folder)
    scaling = ckpt.config.rope_scaling
    assert (scaling["rope_type"], scaling["original_max_position_embeddings"]) == ("longrope", original)
    assert scaling["long_factor"] == pytest.approx(hf.config.rope_parameters["long_factor"], rel=1e-6)
    assert scaling["attention_factor"] == pytest.approx((1 + torch.log(torch.tensor(256 / original)).item()
                                                         / torch.log(torch.tensor(float(original))).item()) ** 0.5)
    long_prompt = [(7 * i + 3) % 256 for i in range(30)]
    short_prompt = IDS[:14]
    for prompt, max_position in ((long_prompt, None), (short_prompt, original)):
        ours = our_logits(build_model(ckpt.config, ckpt.weights(progress=False), max_position=max_position),
                          [prompt], 0)[0]
        safetensors = our_logits(build_model(hf_ckpt.config, hf_ckpt.weights(progress=False),
                                             max_position=max_position), [prompt], 0)[0]
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0].float()
        _check_close(ours, safetensors)
        torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


# --- metadata that only llama.cpp's rules say, and what is refused ---

def _meta(arch: str, **extra) -> dict:
    meta = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.embedding_length": 64,
            f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4, f"{arch}.context_length": 256,
            f"{arch}.vocab_size": 258}
    return {**meta, **{f"{arch}.{k}": v for k, v in extra.items()}}


def test_gemma_27b_scale_and_window_pattern_keys():
    # llama.cpp picks the 27B models by layer count and scales their attention by hidden / heads
    big = ModelConfig.from_gguf(_meta("gemma2", block_count=46, embedding_length=4608, **{
        "attention.head_count": 32, "attention.key_length": 128, "attention.sliding_window": 4096}))
    assert big.attn_scale == 144 ** -0.5 and big.sliding_layers == tuple(i % 2 == 0 for i in range(46))
    small = ModelConfig.from_gguf(_meta("gemma3", block_count=26, embedding_length=1152, **{
        "attention.head_count": 4, "attention.key_length": 256, "attention.sliding_window": 512}))
    assert small.attn_scale == 256 ** -0.5 and small.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(26))
    # a sliding_window_pattern key, as a period or one bool a layer; no window: no sliding layers
    assert ModelConfig.from_gguf(_meta("gemma3", **{"attention.sliding_window": 8, "attention.sliding_window_pattern":
                                                    2})).sliding_layers == (True, False)
    assert ModelConfig.from_gguf(_meta("gemma3", **{"attention.sliding_window": 8, "attention.sliding_window_pattern":
                                                    [False, True]})).sliding_layers == (False, True)
    none = ModelConfig.from_gguf(_meta("gemma3"))
    assert (none.sliding_window, none.sliding_layers) == (None, None)
    with pytest.raises(ValueError, match=r"m\.gguf: gemma3\.attention\.sliding_window_pattern: expected 2"):
        ModelConfig.from_gguf(_meta("gemma3", **{"attention.sliding_window": 8,
                                                 "attention.sliding_window_pattern": [True]}), where="m.gguf")


def test_phi3_window_zero_and_rotary_count():
    # Phi-4's converter writes sliding_window 0 for "none"
    assert ModelConfig.from_gguf(_meta("phi3", **{"attention.sliding_window": 0})).sliding_window is None
    assert ModelConfig.from_gguf(_meta("phi3", **{"rope.dimension_count": 12})).rotary_dim == 12
    with pytest.raises(ValueError, match=r"phi3\.rope\.dimension_count: expected an int in \[2, 16\], got 24"):
        ModelConfig.from_gguf(_meta("phi3", **{"rope.dimension_count": 24}))


def _tiny_tensors(names) -> dict:
    import numpy as np

    return {n: np.zeros((4,), np.float32) for n in names}


def test_unsupported_architecture_and_tensors(tmp_path):
    # an architecture still unsupported: named with the file, before any of its tensors
    path = write_gguf(tmp_path / "phi2.gguf", "phi2", {"block_count": 1, "embedding_length": 64},
                      _tiny_tensors(["blk.0.attn_qkv.weight"]))
    with pytest.raises(ValueError, match=r"phi2\.gguf: unsupported model architecture 'phi2'; supported: llama, "
                                         r"qwen2, qwen3, gemma2, gemma3, phi3"):
        GGUFCheckpoint(path)
    # a supported architecture with a tensor it does not have (a Qwen3-MoE router; another family's fused qkv)
    for arch, tensor in (("qwen3", "blk.0.ffn_gate_inp.weight"), ("qwen3", "blk.0.attn_qkv.weight"),
                         ("gemma2", "blk.0.attn_q_norm.weight"), ("llama", "rope_factors_long.weight")):
        path = write_gguf(tmp_path / f"{arch}.gguf", arch, {"block_count": 1}, _tiny_tensors([tensor]))
        with pytest.raises(ValueError, match=rf"{arch}\.gguf: tensor {tensor} is not supported by this loader for "
                                             rf"architecture '{arch}'"):
            GGUFCheckpoint(path)
    # LongRoPE needs both factor tensors
    path = write_gguf(tmp_path / "half.gguf", "phi3", {"block_count": 1},
                      _tiny_tensors(["rope_factors_long.weight"]))
    with pytest.raises(ValueError, match=r"half\.gguf: tensor rope_factors_short\.weight is missing"):
        GGUFCheckpoint(path)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3"])
def test_q8_0_file_dequantized_and_cpu_packed(tmp_path_factory, arch):
    """Q8_0 matrices: dequantized at load, our logits equal transformers' GGUF loading (which dequantizes the file
    itself); on the CPU's packed path the projections stored as Llama stores them run from their blocks (Phi-3's
    fused attn_qkv and ffn_up are dequantized at load), within the packed path's rounding of the dequantized
    logits, with the same greedy tokens."""
    from anygpu.models import gguf_packed
    from anygpu.nn.linear_gguf import GGUFLinear
    from anygpu.quant import gguf_int4pack

    cls, config, missing_from_gguf = _family(arch)
    _, hf = save_tiny(tmp_path_factory, cls, config)
    out = tmp_path_factory.mktemp(f"{arch}-q8")
    path = write_hf_as_gguf(out / f"{arch}.gguf", hf, matrix_type="Q8_0")
    ckpt = GGUFCheckpoint(path)
    assert {t.type_name for t in ckpt.tensors} == {"Q8_0", "F32"}
    reference = build_model(ckpt.config, ckpt.weights(progress=False))
    dequantized = full_logits(reference, IDS)
    tf_gguf = cls.from_pretrained(str(out), gguf_file=f"{arch}.gguf", dtype=torch.float32, **missing_from_gguf).eval()
    with torch.inference_mode():
        expected = tf_gguf(torch.tensor([IDS])).logits[0].float()
    _check_close(dequantized, expected)

    if not gguf_int4pack.supported():
        pytest.skip("this torch has no CPU int4 matmul")
    model = build_model(ckpt.config, ckpt.weights(progress=False, skip=gguf_packed.packed_tensors(ckpt)),
                        prepare=lambda m: gguf_packed.pack_linears(m, ckpt))
    # (the head's 258 rows are not the packed layout's multiple of 16: it stays dequantized here)
    packed = {name: m for name, m in model.named_modules() if isinstance(m, GGUFLinear)}
    if arch == "phi3":
        assert {n.split(".", 2)[-1] for n in packed} == {"self_attn.o_proj", "mlp.down_proj"}
    else:
        assert {n.split(".", 2)[-1] for n in packed} == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                         "mlp.down_proj"}
    references = dict(reference.named_modules())
    for name, layer in packed.items():  # each packed projection is its dequantized one (to the layout's bf16 scales)
        x = torch.randn(3, layer.in_features)
        with torch.inference_mode():
            want = references[name](x)
            assert (layer(x) - want).norm() / want.norm() < 4e-3, name
    got = full_logits(model, IDS)
    torch.testing.assert_close(got, dequantized, atol=0.03 * dequantized.abs().max().item(), rtol=0)
    assert torch.equal(got.argmax(-1), dequantized.argmax(-1))
