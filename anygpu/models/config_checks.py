"""Type and range checks for model config values, before anything is sized from them.

    field = Fields(cfg_dict, where="/models/x/config.json")
    layers = field.int("num_hidden_layers", LIMITS["num_layers"])   # ValueError naming the file and the key

A config value sizes allocations (layers x weights, the rotary table, the embedding), so a wrong one must fail here
with the file and the key, not later as a ZeroDivisionError, a KeyError or a 256 GB allocation.  The limits are
generous bounds on real models (the largest open ones are far inside them), not tuning knobs:

    vocab_size <= 2^24 (16.7M; the largest real ones are ~262k)      hidden_size <= 65536 (Llama 3.1 405B: 16384)
    intermediate_size <= 2^20 (405B: 53248)                           num_layers <= 1024 (405B: 126)
    num_heads, num_kv_heads <= 1024, head_dim <= 1024 and even        max_position <= 2^24 (Llama 4 Scout: 10M)
    0 < rms_norm_eps < 1, 1 < rope_theta <= 1e12, token ids in [0, 2^31)

Whether a model that passes them fits in memory is ``memory_check``'s question; whether the config matches its
checkpoint's tensors is ``shape_check``'s.
"""

from __future__ import annotations

import math

LIMITS = {  # ModelConfig field: (lowest, highest), both allowed
    "vocab_size": (1, 1 << 24),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 20),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (2, 1024),
    "max_position": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "token_id": (0, (1 << 31) - 1),
}
EPS_RANGE = (0.0, 1.0)  # both excluded
THETA_RANGE = (1.0, 1e12)  # low excluded: the rotary base must be > 1
SCALING_FACTOR_RANGE = (0.0, 1e6)  # low excluded


def _is_int(value) -> bool:
    # JSON has one number type: "4096.0" or "1e9" parse as floats; an integral float is an int (then range-checked).
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float)
                                                                        and value.is_integer())


def check_int(value, key: str, limits: tuple[int, int], where: str) -> int:
    lo, hi = limits
    if not _is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{where}: {key}: expected an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def check_float(value, key: str, limits: tuple[float, float], where: str, *, low_open: bool = True,
                high_open: bool = False) -> float:
    lo, hi = limits
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if low_open else value >= lo) and (value < hi if high_open else value <= hi)
    if not ok:
        interval = f"{'(' if low_open else '['}{lo:g}, {hi:g}{')' if high_open else ']'}"
        raise ValueError(f"{where}: {key}: expected a finite number in {interval}, got {value!r}")
    return float(value)


def check_bool(value, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key}: expected true or false, got {value!r}")
    return value


class Fields:
    """Typed reads of one config dict (config.json, GGUF metadata), each error naming ``where`` and the key."""

    _MISSING = object()

    def __init__(self, values: dict, where: str, prefix: str = ""):
        if not isinstance(values, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(values).__name__}")
        self.values, self.where, self.prefix = values, where, prefix

    def raw(self, key: str, default=_MISSING):
        value = self.values.get(self.prefix + key, None)
        if value is None:  # null is how transformers writes "not set" (e.g. "head_dim": null)
            if default is self._MISSING:
                raise ValueError(f"{self.where}: {self.prefix + key}: missing, and it is required")
            return default
        return value

    def int(self, key: str, limits: tuple[int, int], default=_MISSING) -> int | None:
        value = self.raw(key, default)
        return value if value is None else check_int(value, self.prefix + key, limits, self.where)

    def float(self, key: str, limits: tuple[float, float], default=_MISSING, **open_ends) -> float:
        return check_float(self.raw(key, default), self.prefix + key, limits, self.where, **open_ends)

    def bool(self, key: str, default: bool) -> bool:
        return check_bool(self.raw(key, default), self.prefix + key, self.where)


def check_rope_scaling(scaling: dict | None, key: str, where: str) -> dict | None:
    """The numbers rotary scaling divides by or sizes from: finite, positive, and for llama3 distinct frequency
    factors (their difference is a divisor).  Which rope types run is the rotary op's question."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: {key}: expected an object or null, got {scaling!r}")
    rope_type = scaling.get("rope_type")
    if not isinstance(rope_type, str):
        raise ValueError(f"{where}: {key}.rope_type: expected a string, got {rope_type!r}")
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if name in scaling:
            check_float(scaling[name], f"{key}.{name}", SCALING_FACTOR_RANGE, where)
    if "original_max_position_embeddings" in scaling:
        check_int(scaling["original_max_position_embeddings"], f"{key}.original_max_position_embeddings",
                  LIMITS["max_position"], where)
    if rope_type == "llama3" and scaling.get("low_freq_factor") == scaling.get("high_freq_factor"):
        raise ValueError(f"{where}: {key}: llama3 scaling needs low_freq_factor != high_freq_factor, got {scaling!r}")
    return scaling


def check_eos_ids(value, key: str, where: str) -> tuple[int, ...]:
    """An eos id is an int, a list of ints or null (config.json, generation_config.json)."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if len(values) > 1024:
        raise ValueError(f"{where}: {key}: expected at most 1024 token ids, got {len(values)}")
    return tuple(dict.fromkeys(check_int(v, key, LIMITS["token_id"], where) for v in values))  # dedupe, keep order


def check_model_config(cfg, where: str = "ModelConfig", names: dict[str, str] | None = None) -> None:
    """Every field of a ModelConfig (however it was made: a file, a benchmark's dict) in range, and the heads
    consistent: num_kv_heads divides num_heads (grouped-query attention shares each kv head with a group).
    ``names``: the file's key for a field (``{"num_layers": "num_hidden_layers"}``), for the error message."""
    names = names or {}

    def key(field):
        return names.get(field, field)

    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position"):
        check_int(getattr(cfg, name), key(name), LIMITS[name], where)
    if cfg.head_dim % 2:
        raise ValueError(f"{where}: {key('head_dim')}: expected an even number (rotary embeddings rotate pairs), "
                         f"got {cfg.head_dim}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"{where}: {key('num_kv_heads')}: expected a divisor of {key('num_heads')} "
                         f"({cfg.num_heads}), got {cfg.num_kv_heads}")
    if cfg.sliding_window is not None:
        check_int(cfg.sliding_window, key("sliding_window"), LIMITS["sliding_window"], where)
    check_float(cfg.rms_norm_eps, key("rms_norm_eps"), EPS_RANGE, where, high_open=True)
    check_float(cfg.rope_theta, key("rope_theta"), THETA_RANGE, where)
    check_rope_scaling(cfg.rope_scaling, key("rope_scaling"), where)
    for name in ("tie_word_embeddings", "attention_bias"):
        check_bool(getattr(cfg, name), key(name), where)
    _check_family_fields(cfg, key, where)
    if cfg.bos_token_id is not None:
        check_int(cfg.bos_token_id, key("bos_token_id"), LIMITS["token_id"], where)
    if not isinstance(cfg.eos_token_ids, tuple):
        raise ValueError(f"{where}: {key('eos_token_ids')}: expected a tuple of ints, got {cfg.eos_token_ids!r}")
    check_eos_ids(list(cfg.eos_token_ids), key("eos_token_ids"), where)


ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


def _check_family_fields(cfg, key, where: str) -> None:
    """The fields only some families set (absent from a namespace built for another family: their defaults)."""
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: {key('hidden_act')}: expected one of {ACTIVATIONS}, got {act!r}")
    for name, limits in (("attn_scale", (0.0, 1e6)), ("attn_softcap", (0.0, 1e6)), ("final_softcap", (0.0, 1e6)),
                         ("rope_local_theta", THETA_RANGE)):
        if getattr(cfg, name, None) is not None:
            check_float(getattr(cfg, name), key(name), limits, where)
    layers = getattr(cfg, "sliding_layers", None)
    if layers is not None and (not isinstance(layers, tuple) or len(layers) != cfg.num_layers
                               or not all(isinstance(b, bool) for b in layers)):
        raise ValueError(f"{where}: {key('sliding_layers')}: expected a tuple of {cfg.num_layers} bools (one a layer), "
                         f"got {layers!r:.200}")
    partial = check_float(getattr(cfg, "partial_rotary_factor", 1.0), key("partial_rotary_factor"), (0.0, 1.0), where)
    rot = int(cfg.head_dim * partial)
    if rot < 2 or rot % 2:
        raise ValueError(f"{where}: {key('partial_rotary_factor')}: head_dim ({cfg.head_dim}) x {partial} = {rot} "
                         "values rotate; expected an even number >= 2 (rotary embeddings rotate pairs)")
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.get("rope_type") == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = scaling.get(name)
            if (not isinstance(factors, (list, tuple)) or len(factors) != rot // 2
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                               for v in factors)):
                raise ValueError(f"{where}: {key('rope_scaling')}.{name}: expected {rot // 2} positive numbers (one a "
                                 f"rotated pair), got {factors!r:.200}")
        if "original_max_position_embeddings" not in scaling:
            raise ValueError(f"{where}: {key('rope_scaling')}.original_max_position_embeddings: missing; longrope "
                             "switches from short_factor to long_factor there")
    if scaling is not None and scaling.get("rope_type") == "freq_factors":
        factors = scaling.get("freq_factors")
        if (not isinstance(factors, (list, tuple)) or len(factors) != rot // 2
                or not all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in factors)):
            raise ValueError(f"{where}: rope_freqs.weight: expected {rot // 2} positive finite factors (one a rotated "
                             f"pair), got {factors!r:.200}")
