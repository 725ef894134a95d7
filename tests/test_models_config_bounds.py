"""Config values checked before use (issue 21, item 4): type and range, against the checkpoint's own tensors, and
against free memory before the weights and the rotary table are allocated.

The probe's cases: ``max_position_embeddings: 1e9`` (the rotary table was built first: > 5 GiB of RSS),
``num_hidden_layers: 1e6`` (5 GiB after minutes), huge ``vocab_size`` / ``hidden_size`` (an allocator traceback).
Each is now a ValueError naming the file and the key, raised before anything is sized from the value.
"""

import json
import resource

import numpy as np
import pytest
import torch

from anygpu.models import GGUFCheckpoint, HFCheckpoint, ModelConfig
from anygpu.models.config_checks import LIMITS
from anygpu.models.llama import LlamaForCausalLM
from anygpu.models.memory_check import check_model_fits
from anygpu.models.registry import build_model

from .test_models_gguf import _write
from .test_models_hf_errors import CONFIG, make_folder


def _config_text(**changes) -> str:
    """config.json text with some values written literally (``1e9`` is how the probe wrote them: a JSON float)."""
    text = json.dumps({k: v for k, v in CONFIG.items() if k not in changes})
    extra = ", ".join(f'"{k}": {v}' for k, v in changes.items())
    return text[:-1] + (", " + extra if extra else "") + "}"


def _open(tmp_path, **changes):
    folder = make_folder(tmp_path / "m")
    (folder / "config.json").write_text(_config_text(**changes))
    return HFCheckpoint(folder)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("key, literal, pattern", [
    ("max_position_embeddings", "1e9", r"max_position_embeddings: expected an int in \[1, 16777216\], got 1000000000"),
    ("num_hidden_layers", "1e6", r"num_hidden_layers: expected an int in \[1, 1024\], got 1000000"),
    ("vocab_size", "1e12", r"vocab_size: expected an int in \[1, 16777216\]"),
    ("hidden_size", "1e9", r"hidden_size: expected an int in \[1, 65536\]"),
    ("intermediate_size", "-5", r"intermediate_size: expected an int in \[1, 1048576\], got -5"),
    ("num_key_value_heads", "0", r"num_key_value_heads: expected an int in \[1, 1024\], got 0"),
    ("head_dim", "15", r"head_dim: expected an even number"),
    ("num_key_value_heads", "3", r"num_key_value_heads: expected a divisor of num_attention_heads \(2\), got 3"),
    ("num_hidden_layers", "2.5", r"num_hidden_layers: expected an int in \[1, 1024\], got 2.5"),
    ("num_hidden_layers", "true", r"num_hidden_layers: expected an int .* got True"),
    ("num_hidden_layers", '"2"', r"num_hidden_layers: expected an int .* got '2'"),
    ("rms_norm_eps", "NaN", r"rms_norm_eps: expected a finite number in \(0, 1\), got nan"),
    ("rms_norm_eps", "0", r"rms_norm_eps: expected a finite number in \(0, 1\), got 0"),
    ("rope_theta", "1", r"rope_theta: expected a finite number in \(1, 1e\+12\], got 1"),
    ("rope_theta", "Infinity", r"rope_theta: expected a finite number"),
    ("rope_scaling", '{"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 1, '
                     '"original_max_position_embeddings": 8192}', "low_freq_factor != high_freq_factor"),
    ("rope_scaling", '{"rope_type": "linear", "factor": 0}', r"rope_scaling.factor: expected a finite number"),
    ("rope_scaling", "[2]", "rope_scaling: expected an object or null"),
    ("sliding_window", "-1", r"sliding_window: expected an int in \[1, 16777216\], got -1"),
    ("eos_token_id", "[2, -1]", r"eos_token_id: expected an int in \[0, 2147483647\], got -1"),
    ("bos_token_id", "1e20", r"bos_token_id: expected an int"),
    ("tie_word_embeddings", '"yes"', "tie_word_embeddings: expected true or false, got 'yes'"),
])
def test_config_value_out_of_range(tmp_path, key, literal, pattern):
    before = _rss_mib()
    with pytest.raises(ValueError, match=pattern) as info:
        _open(tmp_path, **{key: literal})
    assert str(tmp_path / "m" / "config.json") in str(info.value)
    assert _rss_mib() - before < 200  # nothing was sized from the value (the probe's 1e9 took > 5 GiB)


def test_hidden_not_a_multiple_of_heads(tmp_path):
    with pytest.raises(ValueError, match=r"config.json: hidden_size \(32\) is not a multiple of num_attention_heads"):
        _open(tmp_path, num_attention_heads="3", num_key_value_heads="1")


@pytest.mark.parametrize("key, literal, pattern", [
    ("num_hidden_layers", "3", r"holds 2 layer\(s\), numbered 0 to 1, but .*config.json says num_hidden_layers = 3"),
    ("num_hidden_layers", "1", r"holds 2 layer\(s\).* num_hidden_layers = 1"),
    ("num_hidden_layers", "1000", r"holds 2 layer\(s\).* num_hidden_layers = 1000"),
    ("vocab_size", "10000000", r"'model.embed_tokens.weight' has shape \(64, 32\), but .*config.json gives "
                               r"\(10000000, 32\) \(vocab_size, hidden_size\)"),
    ("hidden_size", "64", r"'model.embed_tokens.weight' has shape \(64, 32\), .* \(64, 64\) \(vocab_size, hidden_size"),
    ("intermediate_size", "4096", r"mlp\.\w+_proj.weight' has shape .*config.json gives .*intermediate_size"),
    ("num_key_value_heads", "2", r"k_proj.weight' has shape \(16, 32\).* \(32, 32\) \(num_key_value_heads x head_dim"),
])
def test_config_disagrees_with_its_tensors(tmp_path, key, literal, pattern):
    """In range, but not what the checkpoint holds: refused when the folder is opened, from the headers alone."""
    with pytest.raises(ValueError, match=pattern) as info:
        _open(tmp_path, **{key: literal})
    assert str(tmp_path / "m") in str(info.value)


def test_model_config_checked_however_made():
    fields = dict(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                  max_position=256, tie_word_embeddings=True, attention_bias=False, sliding_window=None,
                  bos_token_id=1, eos_token_ids=(2,), dtype=None)
    ModelConfig(**fields)
    with pytest.raises(ValueError, match=r"ModelConfig: num_layers: expected an int in \[1, 1024\], got 1000000"):
        ModelConfig(**{**fields, "num_layers": 10**6})
    with pytest.raises(ValueError, match=r"ModelConfig: max_position: expected an int in \[1, 16777216\]"):
        ModelConfig(**{**fields, "max_position": 10**9})


# --- memory: refused before allocating, naming the field ---

def _config(**changes):
    base = ModelConfig.from_hf(CONFIG)
    return ModelConfig(**{**base.__dict__, **changes})


def test_weights_that_cannot_fit_are_refused_before_allocating():
    """At the limits every value is in range, and the weights would be 4 TiB: refused on the meta device."""
    cfg = _config(vocab_size=LIMITS["vocab_size"][1], hidden_size=LIMITS["hidden_size"][1], head_dim=16,
                  tie_word_embeddings=False)
    before = _rss_mib()
    with pytest.raises(ValueError, match=r"the weights need 8192.\d+ GiB \(num_layers 2, hidden_size 65536, .*"
                                         r"vocab_size 16777216\).* but cpu has .* free"):
        build_model(cfg, "random")
    assert _rss_mib() - before < 200


def test_rotary_table_that_cannot_fit_names_max_position():
    cfg = _config(max_position=LIMITS["max_position"][1], head_dim=1024, num_heads=1, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"max_position: the rotary table for 16777216 positions \(head_dim 1024\) "
                                         r"needs 384.00 GiB .* serve a shorter context \(max_model_len\)"):
        check_model_fits(cfg, param_bytes=1 << 20, max_position=cfg.max_position, device=torch.device("cpu"),
                         free=64 << 30)
    check_model_fits(cfg, param_bytes=1 << 20, max_position=4096, device=torch.device("cpu"), free=64 << 30)


def test_rotary_table_sized_by_the_context_actually_used():
    """A config declaring 16M positions, run with a 256-token context: the table has 256 rows, not 16M."""
    cfg = _config(max_position=LIMITS["max_position"][1])
    model = LlamaForCausalLM(cfg, max_position=256)
    assert model.rotary.shape == (256, 16)
    assert torch.equal(model.rotary, LlamaForCausalLM(_config(max_position=256)).rotary)
    assert LlamaForCausalLM(_config(max_position=128), max_position=4096).rotary.shape[0] == 128  # never above
    with pytest.raises(ValueError, match="max_position: expected a positive int or None, got 0"):
        LlamaForCausalLM(cfg, max_position=0)
    model = build_model(_config(max_position=1024), "random", max_position=100)
    assert model.rotary.shape[0] == 100


# --- GGUF metadata: the same checks ---


def _gguf(path, **meta):
    """A 1-layer llama GGUF (hidden 32, 2 heads, 1 kv head), written by gguf.GGUFWriter, with ``meta`` overrides."""
    tensors = {"token_embd.weight": (np.zeros((258, 32), np.float32), "F32")}
    for name, shape in {"attn_q": (32, 32), "attn_k": (16, 32), "attn_v": (16, 32), "attn_output": (32, 32),
                        "ffn_gate": (64, 32), "ffn_up": (64, 32), "ffn_down": (32, 64), "attn_norm": (32,),
                        "ffn_norm": (32,)}.items():
        tensors[f"blk.0.{name}.weight"] = (np.zeros(shape, np.float32), "F32")
    tensors["output_norm.weight"] = (np.ones(32, np.float32), "F32")
    return _write(path, tensors=tensors, meta=meta)


def test_gguf_good_file_opens(tmp_path):
    assert GGUFCheckpoint(_gguf(tmp_path / "m.gguf")).config.num_layers == 1


@pytest.mark.parametrize("meta, pattern", [
    ({"block_count": 1_000_000}, r"llama.block_count: expected an int in \[1, 1024\], got 1000000"),
    ({"context_length": 1_000_000_000}, r"llama.context_length: expected an int in \[1, 16777216\]"),
    ({"attention.head_count": 0}, r"llama.attention.head_count: expected an int in \[1, 1024\], got 0"),
    ({"embedding_length": 1 << 20}, r"llama.embedding_length: expected an int in \[1, 65536\]"),
    ({"block_count": 2}, r"holds 1 layer\(s\), numbered 0 to 0, but its metadata says llama.block_count = 2"),
    ({"feed_forward_length": 128}, r"gate_proj.weight' has shape \(64, 32\).* \(llama.feed_forward_length"),
    ({"vocab_size": 1000}, r"embed_tokens.weight' has shape \(258, 32\).* \(1000, 32\) \(llama.vocab_size"),
])
def test_gguf_metadata_checked(tmp_path, meta, pattern):
    path = _gguf(tmp_path / "m.gguf", **meta)
    with pytest.raises(ValueError, match=pattern) as info:
        GGUFCheckpoint(path)
    assert str(path) in str(info.value)
