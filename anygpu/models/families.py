"""What each supported model family changes in the one decoder (``llama.py``), declared, not coded.

    FAMILIES["gemma2"].sandwich_norms        # True: RMSNorm after attention and around the MLP too
    family_hf_fields("qwen3", Fields(cfg, where))   # the config.json values only that family has

A ``Family`` holds the structural traits (which norms and tensors exist, how the checkpoint stores them); the
numbers that vary between checkpoints of one family (soft-cap values, windows, the local rope base, the rotary
fraction) are ``ModelConfig`` fields, read here from config.json by ``family_hf_fields``.  The model reads both
and has no per-family code path beyond these switches.

| family  | difference from Llama                                                                           |
|---------|-------------------------------------------------------------------------------------------------|
| mistral | a sliding window on every layer                                                                 |
| qwen2   | q/k/v biases                                                                                     |
| qwen3   | RMSNorm of each q and k head before rotary (q_norm, k_norm)                                      |
| gemma2  | RMSNorm by (1 + weight), x * sqrt(hidden) embeddings, sandwich norms, GELU-tanh MLP, attention  |
|         | and final logit soft-capping, query_pre_attn_scalar, sliding / global layers alternating          |
| gemma3  | gemma2 without soft-capping, plus q/k norm and a rope base of its own for the sliding layers      |
| phi3    | q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), partial rotary, longrope scaling         |
"""

from __future__ import annotations

from dataclasses import dataclass

from .config_checks import LIMITS, SCALING_FACTOR_RANGE, THETA_RANGE, Fields, check_float


@dataclass(frozen=True)
class Family:
    qkv_bias: bool | None = None      # True: always q/k/v biases (Qwen2); None: config.json's attention_bias
    qk_norm: bool = False             # RMSNorm over each head of q and k, before rotary
    norm_offset: float = 0.0          # RMSNorm multiplies by (offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False      # post_attention_layernorm after attention, pre/post_feedforward_layernorm
    scaled_embeddings: bool = False   # embeddings times sqrt(hidden_size)
    fused_checkpoint: bool = False    # the checkpoint stores qkv_proj and gate_up_proj fused, as we run them
    tie_default: bool = False         # tie_word_embeddings when config.json does not say
    window_flag: str | None = None    # the config.json switch that turns sliding_window on (None: always on)


_GEMMA = dict(norm_offset=1.0, sandwich_norms=True, scaled_embeddings=True, tie_default=True)
FAMILIES = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True, window_flag="use_sliding_window"),
    "qwen3": Family(qk_norm=True, window_flag="use_sliding_window"),
    "gemma2": Family(**_GEMMA),
    "gemma3": Family(**_GEMMA, qk_norm=True),
    "phi3": Family(fused_checkpoint=True),
}
# transformers' class name -> family.  Gemma3ForCausalLM is the text-only model (gemma-3-1b, or a text config).
HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
              "Phi3ForCausalLM": "phi3"}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3_text": "gemma3", "phi3": "phi3"}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
SOFTCAP_RANGE = (0.0, 1e6)  # low excluded


def family_hf_fields(arch: str, f: Fields, num_layers: int) -> dict:
    """The ModelConfig fields config.json sets only for some families: activation, attention scale and soft-caps,
    which layers slide, Gemma 3's local rope base.  Each error names the file and the key."""
    out: dict = {}
    act_key = "hidden_activation" if arch.startswith("gemma") else "hidden_act"
    act = f.raw(act_key, "gelu_pytorch_tanh" if arch.startswith("gemma") else "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{f.where}: {act_key}: unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
    out["hidden_act"] = ACTIVATIONS[act]
    flag = FAMILIES[arch].window_flag
    if flag is not None and f.bool(flag, False):
        # Qwen2/3: only the layers from max_window_layers on slide (transformers' own layer_types says the same)
        first = f.int("max_window_layers", (0, LIMITS["num_layers"][1]), 28)
        out["sliding_layers"] = _sliding_layers(f, num_layers, tuple(i >= first for i in range(num_layers)))
    if not arch.startswith("gemma"):
        return out
    if f.bool("use_bidirectional_attention", False):
        raise ValueError(f"{f.where}: use_bidirectional_attention: true (an embedding model) is not supported; "
                         "this engine runs causal decoders")
    out["attn_scale"] = f.float("query_pre_attn_scalar", (0.0, 1e9), 256.0) ** -0.5
    for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        value = f.raw(key, None)
        out[field] = None if value is None else check_float(value, key, SOFTCAP_RANGE, f.where)
    # Without layer_types: every layer but each pattern-th slides (transformers' sliding_window_pattern: Gemma 2
    # alternates, Gemma 3 has one global layer in six).
    pattern = f.int("sliding_window_pattern", (1, LIMITS["num_layers"][1]), 2 if arch == "gemma2" else 6)
    out["sliding_layers"] = _sliding_layers(f, num_layers, tuple(bool((i + 1) % pattern) for i in range(num_layers)))
    return out


def _sliding_layers(f: Fields, num_layers: int, default: tuple[bool, ...]) -> tuple[bool, ...]:
    """Which layers use the sliding window: config.json's layer_types, else ``default``."""
    types = f.raw("layer_types", None)
    if types is None:
        return default
    known = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != num_layers or any(t not in known for t in types):
        raise ValueError(f"{f.where}: layer_types: expected a list of {num_layers} (num_hidden_layers) entries, each "
                         f"'sliding_attention' or 'full_attention', got {types!r:.200}")
    return tuple(t == "sliding_attention" for t in types)


def gemma3_rope(f: Fields) -> tuple[float, dict | None, float]:
    """Gemma 3's (global rope_theta, global rope_scaling, local rope base): transformers 5 nests them by layer
    type in rope_parameters; 4.x has rope_theta, rope_scaling and rope_local_base_freq side by side."""
    params = f.raw("rope_parameters", None)
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{f.where}: rope_parameters.sliding_attention.rope_type: only 'default' is supported "
                             f"for the sliding layers, got {local.get('rope_type')!r}")
        theta = check_float(full.get("rope_theta", 1e6), "rope_parameters.full_attention.rope_theta",
                            THETA_RANGE, f.where)
        local_theta = check_float(local.get("rope_theta", 1e4), "rope_parameters.sliding_attention.rope_theta",
                                  THETA_RANGE, f.where)
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    else:
        theta = f.float("rope_theta", THETA_RANGE, 1e6)
        local_theta = f.float("rope_local_base_freq", THETA_RANGE, 1e4)
        scaling = f.raw("rope_scaling", {})
        if not isinstance(scaling, dict):
            raise ValueError(f"{f.where}: rope_scaling: expected an object or null, got {scaling!r}")
        scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    elif "factor" in scaling:
        check_float(scaling["factor"], "rope_scaling.factor", SCALING_FACTOR_RANGE, f.where)
    return theta, scaling, local_theta


def phi3_rope(scaling: dict | None, f: Fields) -> dict | None:
    """Phi-3's rope_scaling as the rotary table reads it: "su" and "yarn" are its names for longrope (transformers'
    Phi3Config renames them too), and 4.x configs keep original_max_position_embeddings at the top level."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    if scaling["rope_type"] in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] == "longrope" and "original_max_position_embeddings" not in scaling:
        original = f.int("original_max_position_embeddings", LIMITS["max_position"], None)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
    return scaling
