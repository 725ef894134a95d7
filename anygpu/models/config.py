"""``ModelConfig``: the shape of a decoder-only transformer, read from a Hugging Face ``config.json`` or GGUF metadata.

    ModelConfig.from_hf(json.load(open("config.json")))      # transformers 4.x or 5.x keys
    ModelConfig.from_gguf(metadata, tensor_names=names)      # llama.cpp's "<arch>.block_count"... keys

One frozen dataclass for every supported family (Llama 2/3, Mistral, Qwen2, SmolLM2), so the model code reads
the same fields whatever the file format.  Anything else is refused here, with the name of the architecture,
before a single weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
_GGUF_ARCHITECTURES = ("llama", "qwen2")  # Mistral GGUFs say "llama": same tensors, same permutation
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _unsupported(arch: object, supported: Iterable[str]) -> ValueError:
    return ValueError(f"unsupported model architecture {arch!r}; supported: {', '.join(supported)}")


def _eos_tuple(value) -> tuple[int, ...]:
    """config.json's eos_token_id is an int, a list of ints or null."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(dict.fromkeys(int(v) for v in values))  # dedupe, keep order


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None    # HF rope_scaling / rope_parameters minus rope_theta; None for "default"
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool         # q/k/v biases (Qwen2)
    sliding_window: int | None   # None: full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype | None    # the checkpoint's dtype (None for GGUF: dequantized to fp32)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From a ``config.json`` dict as saved by transformers 4.x (rope_theta, rope_scaling, torch_dtype) or 5.x
        (rope_parameters, dtype)."""
        classes = cfg.get("architectures") or []
        arch = next((_HF_CLASSES[c] for c in classes if c in _HF_CLASSES), None)
        if arch is None:
            if classes or cfg.get("model_type") not in SUPPORTED_ARCHITECTURES:
                raise _unsupported(classes[0] if classes else cfg.get("model_type"), list(_HF_CLASSES))
            arch = cfg["model_type"]
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope_theta, rope_scaling = _hf_rope(cfg)
        if arch == "qwen2":  # Qwen2 always has q/k/v biases; its sliding window is off unless asked for
            bias, window = True, cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        else:
            bias, window = bool(cfg.get("attention_bias", False)), cfg.get("sliding_window")
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),  # Mistral configs may say "head_dim": null
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
            dtype=_DTYPES.get(dtype) if isinstance(dtype, str) else None,
        )

    @classmethod
    def from_gguf(cls, metadata: dict, tensor_names: Iterable[str] | None = None) -> ModelConfig:
        """From GGUF metadata (``reader.fields[key].contents()`` by key).  Tied embeddings and Llama biases are
        not in the metadata but in which tensors exist: pass ``tensor_names`` (None: tied, no Llama bias)."""
        arch = metadata.get("general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            raise _unsupported(arch, _GGUF_ARCHITECTURES)
        names = set(tensor_names or ())

        def get(key, default=None):
            return metadata.get(f"{arch}.{key}", default)

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        vocab = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
        scaling_type = get("rope.scaling.type")
        rope_scaling = None
        if scaling_type not in (None, "none"):
            rope_scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
            if get("rope.scaling.original_context_length"):
                rope_scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        # llama.cpp stops on eos and on the end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>).
        eos = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        window = get("attention.sliding_window")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv") or heads),
            head_dim=int(get("attention.key_length") or hidden // heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position=int(get("context_length", 2048)),
            tie_word_embeddings=tensor_names is None or "output.weight" not in names,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
            sliding_window=int(window) if window else None,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_eos_tuple([e for e in eos if e is not None]),
            dtype=None,
        )


def _hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None): 5.x nests both in rope_parameters, 4.x has them side by side."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:  # older configs spell it "type"
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return float(theta), scaling
