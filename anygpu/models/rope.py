"""The rotary cos|sin tables a model's layers read: ``rotary_table(config, max_position, device, local=False)``.

Default, linear and llama3 scaling are the rotary op's own table (``ops.rotary_embedding.rotary_cos_sin_cache``);
LongRoPE (Phi-3 / Phi-4-mini, ``rope_type`` "longrope"; ``ModelConfig.from_hf`` renames Phi-3's "su" and "yarn") is built
here: each position has its own row, so the table can say per position which factors apply.

LongRoPE divides each frequency by ``short_factor[i]`` below ``original_max_position_embeddings`` and by
``long_factor[i]`` from there on, and scales cos and sin by ``attention_factor`` (default
``sqrt(1 + ln(factor) / ln(original))`` with ``factor = max_position_embeddings / original``).  transformers picks
the set per forward call from the longest position in it, so a token decoded at position p gets the long set iff
p >= original: the same as this table.  A prompt that crosses ``original`` in one prefill is where the two differ:
transformers rotates all of it with the long set, this table its positions below ``original`` with the short set
(the keys transformers cached from earlier calls keep their short rotation too; vLLM switches the whole batch).
"""

from __future__ import annotations

import math

import torch

from ..ops.rotary_embedding import rotary_cos_sin_cache
from .config import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rotary_table(cfg: ModelConfig, max_position: int, device: torch.device, local: bool = False) -> torch.Tensor:
    """fp32 [max_position, rotary_dim]: row p = [cos | sin] of position p.  ``local``: the sliding layers' table of
    a family with a rope base of its own there (Gemma 3: ``rope_local_theta``, never scaled)."""
    if local:
        return rotary_cos_sin_cache(cfg.rotary_dim, max_position, cfg.rope_local_theta, None, device=device)
    scaling = cfg.rope_scaling
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type: {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "longrope":
        return _longrope(cfg, max_position, device)
    return rotary_cos_sin_cache(cfg.rotary_dim, max_position, cfg.rope_theta, scaling, device=device)


def _longrope(cfg: ModelConfig, max_position: int, device: torch.device) -> torch.Tensor:
    s, rot = cfg.rope_scaling, cfg.rotary_dim
    original = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or cfg.max_position / original)
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    f64 = torch.float64
    base = float(cfg.rope_theta) ** (torch.arange(0, rot, 2, dtype=f64, device=device) / rot)
    short = 1.0 / (torch.tensor(s["short_factor"], dtype=f64, device=device) * base)
    long = 1.0 / (torch.tensor(s["long_factor"], dtype=f64, device=device) * base)
    pos = torch.arange(max_position, dtype=f64, device=device)[:, None]
    angles = pos * torch.where(pos < original, short[None, :], long[None, :])
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * float(attention)).to(torch.float32)
