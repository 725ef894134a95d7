"""``ModelConfig``: the shape of a decoder-only transformer, read from a Hugging Face ``config.json`` or GGUF metadata.

    ModelConfig.from_hf(json.load(open("config.json")))      # transformers 4.x or 5.x keys
    ModelConfig.from_gguf(metadata, tensor_names=names)      # llama.cpp's "<arch>.block_count"... keys

One frozen dataclass for every supported family (Llama 2/3, Mistral, Qwen2, SmolLM2, Qwen3, Gemma 2, Gemma 3 text,
Phi-3 / Phi-4-mini; from config.json or GGUF), so the model code reads the same fields whatever the file format.
What a family changes in the model is declared in ``families.py`` (``ModelConfig.family``); the numbers that vary
within a family are fields here.  Anything else is refused here, with the name of the architecture, before a
single weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable

import torch

from .bnb_config import BnbQuantization
from .config_checks import (
    EPS_RANGE,
    LIMITS,
    SCALING_FACTOR_RANGE,
    THETA_RANGE,
    Fields,
    check_eos_ids,
    check_float,
    check_int,
    check_model_config,
    check_rope_scaling,
)
from .families import (
    FAMILIES,
    HF_CLASSES,
    MODEL_TYPES,
    SOFTCAP_RANGE,
    Family,
    family_hf_fields,
    gemma3_rope,
    phi3_rope,
)

SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys(HF_CLASSES.values()))
_HF_CLASSES = HF_CLASSES
# general.architecture values that load (each is also the family).  Mistral GGUFs say "llama": same tensors,
# same permutation.
_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# llama.cpp's sliding-window period of each Gemma (no key says it): every pattern-th layer is global.
_GGUF_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp picks the 27B Gemmas by their layer count and scales their attention by hidden / heads instead of
# head_dim (their query_pre_attn_scalar).
_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _unsupported(arch: object, supported: Iterable[str], where: str | None = None) -> ValueError:
    prefix = f"{where}: " if where else ""
    return ValueError(f"{prefix}unsupported model architecture {arch!r}; supported: {', '.join(supported)}")


# The config.json / GGUF key of each field that is read under another name, for error messages.
HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings",
            "eos_token_ids": "eos_token_id"}
GGUF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
              "num_layers": "block_count", "num_heads": "attention.head_count",
              "num_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
              "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
              "max_position": "context_length", "sliding_window": "attention.sliding_window",
              "attn_softcap": "attn_logit_softcapping",
              "final_softcap": "final_logit_softcapping", "rope_local_theta": "rope.freq_base_swa",
              "partial_rotary_factor": "rope.dimension_count", "sliding_layers": "attention.sliding_window_pattern"}


def _checked(cls, fields: dict, where: str, names: dict[str, str]):
    """Cross-field checks under the file's key names first, then the dataclass (which checks again, cheaply)."""
    check_model_config(SimpleNamespace(**fields), where, names)
    return cls(**fields)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # a key of families.FAMILIES: "llama", "mistral", "qwen2", "qwen3"...
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
    sliding_window: int | None   # None: full attention (on the layers sliding_layers names, else on all)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype | None    # the checkpoint's dtype (None for GGUF: dequantized to fp32)
    # A bitsandbytes checkpoint's quantization_config: its linears are stored packed and load as they are.
    quantization: BnbQuantization | None = None
    # What only some families set (families.py reads them from config.json); the defaults are Llama's.
    hidden_act: str = "silu"                   # the gated MLP's activation: "silu", "gelu_tanh" or "gelu"
    attn_scale: float | None = None            # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None          # attention logits -> cap * tanh(logits / cap) (Gemma 2)
    final_softcap: float | None = None         # the same on the output logits (Gemma 2)
    sliding_layers: tuple[bool, ...] | None = None  # which layers slide; None: all of them (when sliding_window)
    rope_local_theta: float | None = None      # the sliding layers' rope base, unscaled (Gemma 3); None: rope_theta
    partial_rotary_factor: float = 1.0         # the fraction of each head that rotates (Phi-3.5 / Phi-4-mini: 0.75)

    def __post_init__(self):
        if self.architecture not in FAMILIES:
            raise ValueError(f"architecture: expected one of {sorted(FAMILIES)}, got {self.architecture!r}")
        check_model_config(self)  # direct constructions too (benchmarks' random-weight configs)

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def rotary_dim(self) -> int:
        """How many values of each head rotate (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> ModelConfig:
        """From a ``config.json`` dict as saved by transformers 4.x (rope_theta, rope_scaling, torch_dtype) or 5.x
        (rope_parameters, dtype).  Every value is type- and range-checked (``config_checks``); an error names
        ``where`` (the file) and the key."""
        f = Fields(cfg, where)
        classes = f.raw("architectures", [])
        if not isinstance(classes, list):
            raise ValueError(f"{where}: architectures: expected a list of class names, got {classes!r}")
        arch = next((_HF_CLASSES[c] for c in classes if isinstance(c, str) and c in _HF_CLASSES), None)
        if arch is None:
            if classes or cfg.get("model_type") not in MODEL_TYPES:
                raise _unsupported(classes[0] if classes else cfg.get("model_type"), list(_HF_CLASSES), where)
            arch = MODEL_TYPES[cfg["model_type"]]
        family = FAMILIES[arch]
        hidden = f.int("hidden_size", LIMITS["hidden_size"])
        heads = f.int("num_attention_heads", LIMITS["num_heads"])
        head_dim = f.int("head_dim", LIMITS["head_dim"], None)  # Mistral configs may say "head_dim": null
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                                 f"({heads}), and there is no head_dim to say the head size")
            head_dim = hidden // heads
        num_layers = f.int("num_hidden_layers", LIMITS["num_layers"])
        extra = family_hf_fields(arch, f, num_layers)
        if arch == "gemma3":
            rope_theta, rope_scaling, extra["rope_local_theta"] = gemma3_rope(f)
            rope_scaling = check_rope_scaling(rope_scaling, "rope_scaling", where)
        else:
            rope_theta, rope_scaling, extra["partial_rotary_factor"] = _hf_rope(f)
            if arch == "phi3":
                rope_scaling = phi3_rope(rope_scaling, f)
        # Qwen2 always has q/k/v biases; its (and Qwen3's) sliding window is off unless asked for.
        bias = family.qkv_bias if family.qkv_bias is not None else f.bool("attention_bias", False)
        window_on = family.window_flag is None or f.bool(family.window_flag, False)
        window = f.int("sliding_window", LIMITS["sliding_window"], None) if window_on else None
        if window is None:
            extra.pop("sliding_layers", None)
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        quantization = cfg.get("quantization_config")
        fields = dict(
            architecture=arch,
            vocab_size=f.int("vocab_size", LIMITS["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=f.int("intermediate_size", LIMITS["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=f.int("num_key_value_heads", LIMITS["num_kv_heads"], heads),
            head_dim=head_dim,
            rms_norm_eps=f.float("rms_norm_eps", EPS_RANGE, 1e-6, high_open=True),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position=f.int("max_position_embeddings", LIMITS["max_position"], 2048),
            tie_word_embeddings=f.bool("tie_word_embeddings", family.tie_default),
            attention_bias=bias,
            sliding_window=window,
            bos_token_id=f.int("bos_token_id", LIMITS["token_id"], None),
            eos_token_ids=check_eos_ids(cfg.get("eos_token_id"), "eos_token_id", where),
            dtype=_DTYPES.get(dtype) if isinstance(dtype, str) else None,
            quantization=None if quantization is None else BnbQuantization.from_hf(quantization, where),
            **extra,
        )
        return _checked(cls, fields, where, HF_KEYS)

    @classmethod
    def from_gguf(cls, metadata: dict, tensor_names: Iterable[str] | None = None,
                  where: str = "GGUF metadata", rope_freqs: list[float] | None = None,
                  rope_factors: tuple[list[float], list[float]] | None = None) -> ModelConfig:
        """From GGUF metadata (``reader.fields[key].contents()`` by key), as llama.cpp reads it for each
        architecture (what it hard-codes per family rather than storing, too: Gemma's sliding-window period and
        attention scale, Gemma 3's local rope base).  Tied embeddings and Llama biases are not in the metadata
        but in which tensors exist: pass ``tensor_names`` (None: tied, no Llama bias).
        ``rope_freqs``: the values of a ``rope_freqs.weight`` tensor (llama.cpp's Llama 3.1+ rope scaling: each
        rotated frequency divided by its factor), kept as rope_scaling ``{"rope_type": "freq_factors", ...}``.
        ``rope_factors``: the values of Phi-3's ``rope_factors_long.weight`` and ``rope_factors_short.weight``
        (LongRoPE), kept as rope_scaling ``{"rope_type": "longrope", ...}``.
        Every value is type- and range-checked; an error names ``where`` (the file) and the key."""
        arch = metadata.get("general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            raise _unsupported(arch, _GGUF_ARCHITECTURES, where)
        names = set(tensor_names or ())
        f = Fields(metadata, where, prefix=f"{arch}.")
        hidden = f.int("embedding_length", LIMITS["hidden_size"])
        heads = f.int("attention.head_count", LIMITS["num_heads"])
        head_dim = f.int("attention.key_length", LIMITS["head_dim"], None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"{where}: {arch}.embedding_length ({hidden}) is not a multiple of "
                                 f"{arch}.attention.head_count ({heads}), and there is no attention.key_length")
            head_dim = hidden // heads
        vocab = f.int("vocab_size", LIMITS["vocab_size"], None)
        if vocab is None:
            tokens = metadata.get("tokenizer.ggml.tokens")
            if not isinstance(tokens, (list, tuple)):
                raise ValueError(f"{where}: {arch}.vocab_size: missing, and there is no tokenizer.ggml.tokens list "
                                 "to count")
            vocab = check_int(len(tokens), "tokenizer.ggml.tokens (its length)", LIMITS["vocab_size"], where)
        scaling_type = f.raw("rope.scaling.type", None)
        rope_scaling = None
        if scaling_type not in (None, "none"):
            rope_scaling = {"rope_type": scaling_type,
                            "factor": f.float("rope.scaling.factor", SCALING_FACTOR_RANGE, 1.0)}
            original = f.int("rope.scaling.original_context_length", LIMITS["max_position"], None)
            if original:
                rope_scaling["original_max_position_embeddings"] = original
        if rope_freqs is not None:
            if rope_scaling is not None:
                raise ValueError(f"{where}: {arch}.rope.scaling.type: {scaling_type!r} and a rope_freqs.weight tensor "
                                 "both scale the rotary frequencies; expected one of them")
            rope_scaling = {"rope_type": "freq_factors", "freq_factors": [float(v) for v in rope_freqs]}
        if rope_factors is not None:
            if rope_scaling is not None:
                raise ValueError(f"{where}: rope_factors_long.weight: the rotary frequencies are already scaled "
                                 f"({rope_scaling['rope_type']}); expected one scaling")
            rope_scaling = {"rope_type": "longrope", "long_factor": [float(v) for v in rope_factors[0]],
                            "short_factor": [float(v) for v in rope_factors[1]],
                            "original_max_position_embeddings": f.int("rope.scaling.original_context_length",
                                                                      LIMITS["max_position"])}
            if f.raw("rope.scaling.attn_factor", None) is not None:  # the converter's; cos and sin are scaled by it
                rope_scaling["attention_factor"] = f.float("rope.scaling.attn_factor", SCALING_FACTOR_RANGE)
        # llama.cpp stops on eos and on the end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>).
        eos = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        num_layers = f.int("block_count", LIMITS["num_layers"])
        window = f.int("attention.sliding_window", (0, LIMITS["sliding_window"][1]), None) or None  # 0: none
        fields = dict(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.int("feed_forward_length", LIMITS["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=f.int("attention.head_count_kv", LIMITS["num_kv_heads"], heads),
            head_dim=head_dim,
            rms_norm_eps=f.float("attention.layer_norm_rms_epsilon", EPS_RANGE, 1e-6, high_open=True),
            rope_theta=f.float("rope.freq_base", THETA_RANGE, 10000.0),
            rope_scaling=rope_scaling,
            max_position=f.int("context_length", LIMITS["max_position"], 2048),
            tie_word_embeddings=tensor_names is None or "output.weight" not in names,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
            sliding_window=window,
            bos_token_id=None if bos is None else check_int(bos, "tokenizer.ggml.bos_token_id", LIMITS["token_id"],
                                                            where),
            eos_token_ids=check_eos_ids([e for e in eos if e is not None], "tokenizer.ggml.eos_token_id", where),
            dtype=None,
            **_gguf_family_fields(arch, f, head_dim, hidden // heads, num_layers, window),
        )
        return _checked(cls, fields, where, {k: f"{arch}.{v}" for k, v in GGUF_KEYS.items()})


def _gguf_family_fields(arch: str, f: Fields, head_dim: int, embd_per_head: int, num_layers: int,
                        window: int | None) -> dict:
    """The ModelConfig fields only some families set, from GGUF metadata and llama.cpp's per-architecture rules:
    the rotated part of each head (``rope.dimension_count``: Phi-3.5 / Phi-4-mini rotate 3/4), and Gemma's
    activation, attention scale, soft-caps (Gemma 2), sliding / global layers and local rope base (Gemma 3)."""
    out: dict = {}
    n_rot = f.int("rope.dimension_count", (2, head_dim), None)
    if n_rot is not None and n_rot != head_dim:
        out["partial_rotary_factor"] = n_rot / head_dim
        if int(head_dim * out["partial_rotary_factor"]) != n_rot:
            raise ValueError(f"{f.where}: {f.prefix}rope.dimension_count: {n_rot} of head_dim {head_dim} values is "
                             "not a fraction this engine can represent exactly")
    if arch not in _GGUF_SWA_PATTERN:
        return out
    out["hidden_act"] = "gelu_tanh"
    # llama.cpp: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B models (query_pre_attn_scalar 144, 168)
    scale_dim = embd_per_head if num_layers == _GGUF_GEMMA_27B_LAYERS[arch] else head_dim
    out["attn_scale"] = scale_dim ** -0.5
    if arch == "gemma2":  # llama.cpp reads the soft-caps for Gemma 2 only
        for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
            out[field] = None if f.raw(key, None) is None else f.float(key, SOFTCAP_RANGE)
    else:
        out["rope_local_theta"] = f.float("rope.freq_base_swa", THETA_RANGE, 10000.0)
    if window is not None:
        key = f"{f.prefix}attention.sliding_window_pattern"
        pattern = f.raw("attention.sliding_window_pattern", _GGUF_SWA_PATTERN[arch])
        if isinstance(pattern, (list, tuple)):  # one bool a layer, True: the layer slides
            if len(pattern) != num_layers or not all(isinstance(b, bool) for b in pattern):
                raise ValueError(f"{f.where}: {key}: expected {num_layers} (block_count) bools, got {pattern!r:.200}")
            out["sliding_layers"] = tuple(pattern)
        else:  # a period: every pattern-th layer is global (0: all slide)
            period = check_int(pattern, key, (0, LIMITS["num_layers"][1]), f.where)
            out["sliding_layers"] = tuple(period == 0 or bool((i + 1) % period) for i in range(num_layers))
    return out


def _hf_rope(f: Fields) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor): 5.x nests them in rope_parameters, 4.x has them
    side by side."""
    params = f.raw("rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta_key, scaling_key = "rope_parameters.rope_theta", "rope_parameters"
        theta, scaling = params["rope_theta"], {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta_key, scaling_key = "rope_theta", "rope_scaling"
        theta, scaling = f.raw("rope_theta", 10000.0), f.raw("rope_scaling", {})
        if not isinstance(scaling, dict):
            raise ValueError(f"{f.where}: rope_scaling: expected an object or null, got {scaling!r}")
        scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:  # older configs spell it "type"
        scaling["rope_type"] = scaling.pop("type")
    partial_key = f"{scaling_key}.partial_rotary_factor" if "partial_rotary_factor" in scaling else \
        "partial_rotary_factor"
    partial = scaling.pop("partial_rotary_factor", f.raw("partial_rotary_factor", 1.0))
    partial = check_float(partial, partial_key, (0.0, 1.0), f.where)
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    theta = check_float(theta, theta_key, THETA_RANGE, f.where)
    return theta, check_rope_scaling(scaling, scaling_key, f.where), partial
