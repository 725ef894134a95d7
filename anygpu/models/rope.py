"""The rotary cos|sin tables a model's layers read: ``rotary_table(config, max_position, device, local=False)``.

Default, linear and llama3 scaling are the rotary op's own table (``ops.rotary_embedding.rotary_cos_sin_cache``).
Built here: GGUF's ``rope_freqs.weight`` (llama.cpp's form of Llama 3.1+ scaling, rope_type "freq_factors" here),
which divides each frequency by its factor (the llama3 formula, precomputed), and LongRoPE (Phi-3 / Phi-4-mini,
``rope_type`` "longrope"; ``ModelConfig.from_hf`` renames Phi-3's "su" and "yarn").

LongRoPE divides each frequency by ``short_factor[i]`` for contexts up to ``original_max_position_embeddings`` and
by ``long_factor[i]`` for longer ones, and scales cos and sin by ``attention_factor`` (default
``sqrt(1 + ln(factor) / ln(original))``, ``factor = max_position_embeddings / original``).  Which set applies is
decided once, from the longest context the model will run (``max_position``, the engine's max_model_len), as vLLM
does: every position of every sequence then has one rotation, and the paged KV cache stays valid.  transformers
instead switches a sequence to the long set when it grows past ``original`` and recomputes its whole cache then
(Phi-3's ``prepare_inputs_for_generation``): the two agree on every sequence when max_model_len <= original
(short set), and on sequences longer than ``original`` otherwise (long set); a short prompt under a long
max_model_len runs with the long factors (serve with ``max_model_len`` <= original for the short set).
"""

from __future__ import annotations

import math

import torch

from ..ops.rotary_embedding import rotary_cos_sin_cache
from .config import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors")


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
    if rope_type == "freq_factors":
        return _angles_table(_inv_freq(cfg, device) / torch.tensor(scaling["freq_factors"], dtype=torch.float64,
                                                                    device=device), max_position, 1.0)
    return rotary_cos_sin_cache(cfg.rotary_dim, max_position, cfg.rope_theta, scaling, device=device)


def _longrope(cfg: ModelConfig, max_position: int, device: torch.device) -> torch.Tensor:
    s, rot = cfg.rope_scaling, cfg.rotary_dim
    original = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or cfg.max_position / original)
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = s["long_factor"] if max_position > original else s["short_factor"]
    inv_freq = _inv_freq(cfg, device) / torch.tensor(factors, dtype=torch.float64, device=device)
    return _angles_table(inv_freq, max_position, float(attention))


def _inv_freq(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    rot = cfg.rotary_dim
    return 1.0 / float(cfg.rope_theta) ** (torch.arange(0, rot, 2, dtype=torch.float64, device=device) / rot)


def _angles_table(inv_freq: torch.Tensor, max_position: int, scale: float) -> torch.Tensor:
    """fp32 [max_position, 2 * len(inv_freq)] of [cos | sin] * scale, from float64 angles (as the op's table)."""
    angles = torch.arange(max_position, dtype=torch.float64, device=inv_freq.device)[:, None] * inv_freq[None, :]
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * scale).to(torch.float32)
