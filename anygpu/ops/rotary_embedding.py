"""``rotary_embedding(positions, query, key, cos_sin_cache, is_neox)``: rotary position embedding applied
in place to query and key (vLLM's op semantics), and ``rotary_cos_sin_cache`` to build the cache.

- positions: int64 [T], each in [0, max_position).
- query [T, Hq, D], key [T, Hkv, D]: same dtype (fp16/bf16/fp32), unit stride on D; token and head strides
  are free, so both may be views of a fused QKV projection's output.  Rotated in place; returns nothing.
- cos_sin_cache: fp32 [max_position, rot_dim], each row ``[cos | sin]`` of rot_dim/2 angles; rot_dim is
  even and <= D.  Only the first rot_dim values of each head rotate (partial rotary).
- is_neox: True rotates pairs (i, i + rot_dim/2) (NeoX, HF Llama's rotate_half); False rotates
  interleaved pairs (2i, 2i + 1) (GPT-J).

Pair i becomes (x1 cos_i - x2 sin_i, x2 cos_i + x1 sin_i), computed in fp32 and rounded once to the
dtype (HF rounds cos and sin to the dtype and each product and the sum: a little less accurate).

On the CPU, ``cpu_rotate`` gives the reference's bits in fewer ops: the per-token cos and sin tables are built
once a step (every layer rotates at the same positions) and each tensor takes one multiply-add.

Positions out of range: the CPU reference raises IndexError; the GPU kernel does not check them (that
would need a device-to-host sync on every call) and reads whatever lies outside the cache.  Keep
positions below the cache's length, as the model's max_position_embeddings already does.
Kernel: ``anygpu/kernels/rotary_embedding.py``.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
          is_neox: bool) -> None:
    if query.dim() != 3 or query.dtype not in DTYPES or (query.numel() and query.stride(-1) != 1):
        raise ValueError(f"query: expected a float16, bfloat16 or float32 tensor [tokens, heads, head_dim] with "
                         f"unit stride on head_dim, got {query.dtype} {tuple(query.shape)} strides {query.stride()}")
    tokens, _, head_dim = query.shape
    if (key.dim() != 3 or key.dtype != query.dtype or key.shape[0] != tokens or key.shape[2] != head_dim
            or (key.numel() and key.stride(-1) != 1)):
        raise ValueError(f"key: expected a {query.dtype} tensor [{tokens}, kv_heads, {head_dim}] with unit stride on "
                         f"head_dim, got {key.dtype} {tuple(key.shape)} strides {key.stride()}")
    if positions.dim() != 1 or positions.dtype != torch.int64 or positions.shape[0] != tokens:
        raise ValueError(f"positions: expected an int64 tensor [{tokens}] (query's tokens), got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    rot_dim = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if (cos_sin_cache.dtype != torch.float32 or rot_dim <= 0 or rot_dim % 2 or rot_dim > head_dim
            or cos_sin_cache.stride(-1) != 1):
        raise ValueError(f"cos_sin_cache: expected a float32 tensor [max_position, rot_dim] with rot_dim even, "
                         f"<= head_dim {head_dim} and unit stride, got {cos_sin_cache.dtype} "
                         f"{tuple(cos_sin_cache.shape)} strides {cos_sin_cache.stride()}")
    for name, t in (("key", key), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != query.device:
            raise ValueError(f"{name}: expected a tensor on query's device {query.device}, got {t.device}")


def _rotate_(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> None:
    rot_dim = 2 * cos.shape[-1]
    part = t[..., :rot_dim].float()
    x1, x2 = (part.chunk(2, dim=-1)) if is_neox else (part[..., 0::2], part[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    t[..., :rot_dim] = torch.cat([o1, o2], dim=-1) if is_neox else torch.stack([o1, o2], dim=-1).flatten(-2)


def reference(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
              is_neox: bool) -> None:
    cos, sin = cos_sin_cache.index_select(0, positions)[:, None, :].chunk(2, dim=-1)  # [T, 1, rot_dim / 2]
    _rotate_(query, cos, sin, is_neox)
    _rotate_(key, cos, sin, is_neox)


class _StepTables(threading.local):
    """Per thread, per cos_sin_cache (held weakly): the last positions' (cos2, sin2) tables."""

    def __init__(self):
        self.entries: dict[int, tuple] = {}


_STEP_TABLES = _StepTables()


def _step_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool):
    """[T, 1, rot_dim] fp32 cos2 and sin2 with ``pair * cos2 + turned * sin2`` = the rotation (``turned``: each
    pair swapped), so ``-sin`` is where the reference subtracts: a - b and a + (-b) round alike.  Reused while
    the same table, unchanged (its version counter), is asked at equal positions (a step's layers; compared by
    value, not by identity).  A table made under inference mode has no version counter: never reused."""
    try:
        version = cos_sin_cache._version
    except RuntimeError:  # an inference tensor
        version = None
    entries = _STEP_TABLES.entries
    kept = entries.get(id(cos_sin_cache)) if version is not None else None
    if (kept is not None and kept[0]() is cos_sin_cache and kept[1] == version and kept[2] == is_neox
            and kept[3].shape == positions.shape and torch.equal(kept[3], positions)):
        return kept[4], kept[5]
    cos, sin = cos_sin_cache.index_select(0, positions)[:, None, :].chunk(2, dim=-1)  # [T, 1, rot_dim / 2]
    if is_neox:
        cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
    else:
        cos2, sin2 = cos.repeat_interleave(2, dim=-1), torch.stack([-sin, sin], dim=-1).flatten(-2)
    if version is not None:
        if len(entries) >= 4:  # a model has one or two tables; more are other models' (or freed)
            entries.clear()
        entries[id(cos_sin_cache)] = (weakref.ref(cos_sin_cache), version, is_neox, positions.clone(), cos2, sin2)
    return cos2, sin2


def cpu_rotate(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
               is_neox: bool) -> None:
    """The CPU implementation: the reference's bits, in five ops a tensor (one tensor when key's heads follow
    query's in memory, as views of a fused QKV projection's output do)."""
    cos2, sin2 = _step_tables(positions, cos_sin_cache, is_neox)
    rot_dim = cos2.shape[-1]
    for t in _heads_together(query, key):
        part = t[..., :rot_dim].float()
        if is_neox:
            x1, x2 = part.chunk(2, dim=-1)
            turned = torch.cat([x2, x1], dim=-1)
        else:
            turned = part.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        # one rounding to t's dtype, as the reference's assignment (no fused multiply-add: it rounds otherwise)
        torch.add(part * cos2, turned * sin2, out=t[..., :rot_dim])


def _heads_together(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(query and key as one [T, Hq + Hkv, D] view,) when key's heads continue query's at the same strides in the
    same storage; else (query, key)."""
    tokens, heads = query.shape[:2]
    if (tokens and query.stride()[1:] == key.stride()[1:] and (tokens == 1 or query.stride(0) == key.stride(0))
            and query.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()
            and key.data_ptr() == query.data_ptr() + heads * query.stride(1) * query.element_size()):
        return (query.as_strided((tokens, heads + key.shape[1], query.shape[2]), query.stride()),)
    return query, key


def fake(positions, query, key, cos_sin_cache, is_neox) -> None:
    return None


rotary_embedding = define_op(
    "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, bool is_neox) -> ()",
    check=check,
    reference=reference,
    fake=fake,
    gpu="rotary_embedding:rotary_embedding",
    cpu=cpu_rotate,
)


def _scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """HF transformers' rope_type "linear" and "llama3" frequency scaling (``_compute_llama3_parameters``)."""
    if scaling is None:
        return inv_freq
    if not isinstance(scaling, dict):
        raise ValueError(f"scaling: expected a dict like a config's rope_scaling, or None, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))  # "type": older HF configs' key
    try:
        if rope_type == "default":
            return inv_freq
        if rope_type == "linear":
            return inv_freq / float(scaling["factor"])  # positions / factor, folded into the frequencies
        if rope_type == "llama3":
            factor = float(scaling["factor"])
            low_freq_factor = float(scaling["low_freq_factor"])
            high_freq_factor = float(scaling["high_freq_factor"])
            old_context_len = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"scaling: rope_type {rope_type!r} needs the key {e.args[0]!r}, got {scaling!r}") from None
    if rope_type != "llama3":
        raise ValueError(f"scaling: expected rope_type 'default', 'linear' or 'llama3', got {rope_type!r}")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by factor, short ones kept, and the band between
    # interpolated smoothly from one to the other.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_cos_sin_cache(rot_dim: int, max_position: int, base: float = 10000.0, scaling: dict | None = None,
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``cos_sin_cache`` for ``rotary_embedding``: [max_position, rot_dim], row p = [cos(p f) | sin(p f)]
    with f_i = base^(-2i / rot_dim) (i < rot_dim / 2), scaled as ``scaling`` says (a config's
    ``rope_scaling``: None, ``{"rope_type": "linear", "factor": ...}`` or ``{"rope_type": "llama3",
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``).

    ``rot_dim`` is the head dim, or head_dim * partial_rotary_factor.  Computed in float64 and rounded
    once to ``dtype``: HF computes the angles p * f in fp32, which is off by up to p * 2^-24 radians
    (0.008 at position 131072); ours are the exact angles, rounded.
    """
    if not isinstance(rot_dim, int) or rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim: expected a positive even int, got {rot_dim!r}")
    if not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"max_position: expected a positive int, got {max_position!r}")
    if not (isinstance(base, (int, float)) and base > 1):
        raise ValueError(f"base: expected a number > 1, got {base!r}")
    f64 = torch.float64
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, rot_dim, 2, dtype=f64, device=device) / rot_dim))
    inv_freq = _scaled_inv_freq(inv_freq, scaling)
    angles = torch.arange(max_position, dtype=f64, device=device)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
