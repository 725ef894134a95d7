"""The tensors a ModelConfig implies (``expected_shapes``) and the check of a checkpoint's own tensors against them.

    check_tensor_shapes(config, {"model.embed_tokens.weight": (49152, 576), ...}, where="folder/", config_where=...)

Run when a checkpoint is opened, from its headers only (safetensors headers, GGUF tensor table), so a config that
disagrees with its weights (``num_hidden_layers: 1000000`` over a 2-layer file, a ``vocab_size`` that is not the
embedding's row count) is refused before a model is sized from it, naming the config key and the tensor.
"""

from __future__ import annotations

import re

from .config import ModelConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def expected_shapes(c: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Hugging Face name -> (full shape, which config fields make it) of every tensor of a model of any supported
    family (``config.family`` says which norms exist and whether q/k/v and gate/up are stored fused)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qs, kvs = "num_heads x head_dim", "num_kv_heads x head_dim"
    embed = ((c.vocab_size, c.hidden_size), "vocab_size, hidden_size")
    shapes = {"model.embed_tokens.weight": embed, "model.norm.weight": ((c.hidden_size,), "hidden_size")}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = embed
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": ((c.hidden_size,), "hidden_size"),
                       p + "post_attention_layernorm.weight": ((c.hidden_size,), "hidden_size"),
                       p + "self_attn.q_proj.weight": ((q, c.hidden_size), f"{qs}, hidden_size"),
                       p + "self_attn.k_proj.weight": ((kv, c.hidden_size), f"{kvs}, hidden_size"),
                       p + "self_attn.v_proj.weight": ((kv, c.hidden_size), f"{kvs}, hidden_size"),
                       p + "self_attn.o_proj.weight": ((c.hidden_size, q), f"hidden_size, {qs}"),
                       p + "mlp.gate_proj.weight": ((c.intermediate_size, c.hidden_size),
                                                    "intermediate_size, hidden_size"),
                       p + "mlp.up_proj.weight": ((c.intermediate_size, c.hidden_size),
                                                  "intermediate_size, hidden_size"),
                       p + "mlp.down_proj.weight": ((c.hidden_size, c.intermediate_size),
                                                    "hidden_size, intermediate_size")})
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": ((q,), qs), p + "self_attn.k_proj.bias": ((kv,), kvs),
                           p + "self_attn.v_proj.bias": ((kv,), kvs)})
        family = c.family
        if family.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": ((c.head_dim,), "head_dim"),
                           p + "self_attn.k_norm.weight": ((c.head_dim,), "head_dim")})
        if family.sandwich_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": ((c.hidden_size,), "hidden_size"),
                           p + "post_feedforward_layernorm.weight": ((c.hidden_size,), "hidden_size")})
        if family.fused_checkpoint:  # stored as the engine runs them (Phi-3)
            for fused, parts, shape, fields in (
                    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), (q + 2 * kv, c.hidden_size),
                     f"({qs} + 2 x {kvs}), hidden_size"),
                    ("mlp.gate_up_proj", ("gate_proj", "up_proj"), (2 * c.intermediate_size, c.hidden_size),
                     "2 x intermediate_size, hidden_size")):
                for part in parts:
                    del shapes[p + f"{fused.split('.')[0]}.{part}.weight"]
                shapes[p + fused + ".weight"] = (shape, fields)
    return shapes


def check_tensor_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str,
                        config_where: str, keys: dict[str, str] | None = None) -> None:
    """``shapes``: the checkpoint's tensors by Hugging Face name.  ValueError naming ``where`` (the checkpoint),
    ``config_where`` (the config's file) and the field when the layer count or a known tensor's shape disagrees;
    ``keys``: the file's key of a field (``{"num_layers": "num_hidden_layers"}``) for the message.
    Unknown and missing tensors are load_weights' to name (it sees the same names)."""
    keys = keys or {}

    def named(fields: str) -> str:
        return re.sub(r"[a-z_]+", lambda m: keys.get(m.group(0), m.group(0)), fields)

    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers and layers != set(range(config.num_layers)):
        found = f"{len(layers)} layer(s), numbered {min(layers)} to {max(layers)}"
        raise ValueError(f"{where}: the checkpoint holds {found}, but {config_where} says "
                         f"{named('num_layers')} = {config.num_layers}")
    expected = expected_shapes(config)
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is not None and tuple(shape) != want[0]:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(shape)}, but {config_where} gives "
                             f"{want[0]} ({named(want[1])})")
