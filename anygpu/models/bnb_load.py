"""``build_prequantized``: an engine model from a bitsandbytes checkpoint (config.json ``quantization_config``),
its linears loaded as stored into ``Linear4bit`` / ``Linear8bitLt``.

The model is made on the meta device, so no full-precision linear is ever allocated: the embeddings, norms,
biases and full-precision head are then allocated on the real device and filled from the checkpoint, and each
Linear is replaced by the quantized layer its stored pieces make (``bnb_weights.FusedPieces``) as soon as the
checkpoint has brought all of them.  The model computes in the engine's dtype (``bnb_4bit_compute_dtype`` is
bitsandbytes' choice for transformers' model; the engine's ``--dtype`` is ours).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .bnb_weights import FusedPieces, check_weight_format
from .config import ModelConfig
from .memory_check import check_model_fits
from .parallel import TensorParallel
from .quantized_size import loaded_bytes

# "<prefix>.<projection>.<item>": a linear's weight, one of its quant-state items, or an 8-bit SCB/weight_format.
_LINEAR_ITEM = re.compile(r"(?P<prefix>(?:.*\.)?)(?P<proj>[a-z_]+)\.(?P<item>weight(?:\..+)?|SCB|weight_format)")


def build_prequantized(model_cls, config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                       dtype: torch.dtype, device: torch.device | str, tp: TensorParallel | None,
                       max_position: int | None, where: str = "the checkpoint") -> nn.Module:
    if tp is not None and tp.world_size > 1:
        raise ValueError("tp: bitsandbytes checkpoints run on one device (their packed weights are not cut into "
                         "tensor-parallel shards); run with tp=1")
    device = torch.device(device)
    model = model_cls(config, dtype=dtype, device="meta", max_position=max_position)
    placements = model._placements()  # HF projection -> (our Linear, its first row)
    groups = _linear_groups(model, placements, config, where)
    # Made on meta, the model skipped its memory check: check here what it will hold, quantized.
    kind = "nf4" if config.quantization.bits == 4 else "int8"  # (nf4 and fp4 take the same bytes)
    check_model_fits(config, loaded_bytes(model, dict.fromkeys(groups, kind)), model.max_position, device)
    model.allocate(device, lazy=groups)  # (and the rotary table: none is made on meta)

    params = dict(model.named_parameters())
    fused_starts: dict[str, set[int]] = {}
    for p in placements.values():
        fused_starts.setdefault(p.module, set()).add(p.row)
    expected = {(name, row) for name, p in params.items() if not p.is_meta
                for row in fused_starts.get(name.split(".")[-2] if "." in name else "", {0})}
    written: set[tuple[str, int]] = set()
    threshold = config.quantization.threshold
    for name, tensor in weights:
        target = name.removeprefix("model.")
        if config.tie_word_embeddings and target == "lm_head.weight":
            continue  # a checkpoint may store the tied copy too
        m = _LINEAR_ITEM.fullmatch(target)
        placement = placements.get(m.group("proj")) if m else None
        if placement is not None:  # a linear's weight or quant-state item
            _add_piece(model, groups, m, placement.module, name, tensor, dtype, device, threshold, where)
            continue
        parts = target.split(".")
        placement = placements.get(parts[-2]) if len(parts) >= 2 else None  # a q/k/v bias: its rows of qkv_proj
        if placement is not None:
            target = ".".join([*parts[:-2], placement.module, parts[-1]])
        if target in params and params[target].is_meta:
            raise ValueError(f"{where}: unexpected tensor {name!r}")
        model._copy_in(params, name, target, tensor, placement)
        written.add((target, placement.row if placement else 0))
    if groups:
        module, pieces = next(iter(groups.items()))
        raise ValueError(f"{where}: {len(groups)} layer(s) incomplete, e.g. {module}: missing "
                         f"{', '.join(pieces.missing()[:6])}")
    missing = sorted(expected - written)
    if missing:
        raise ValueError(f"{where}: {len(missing)} tensor(s) missing, e.g. "
                         f"{[f'{n} rows {s}:' if s else n for n, s in missing[:3]]}")
    return model.eval()


def _add_piece(model, groups: dict[str, FusedPieces], m: re.Match, module: str, name: str, tensor: torch.Tensor,
               dtype: torch.dtype, device: torch.device, threshold: float, where: str) -> None:
    """File one checkpoint tensor of a Linear; replace the Linear once all its pieces are in."""
    if m.group("item") == "weight_format":
        check_weight_format(name, tensor, where)
        return
    module = m.group("prefix") + module
    pieces = groups.get(module)
    if pieces is None:
        raise ValueError(f"{where}: unexpected tensor {name!r} (its layer {module} is already loaded, or is not one "
                         "of this model's)")
    pieces.add(m.group("proj"), m.group("item"), name, tensor)
    if pieces.complete():
        parent, _, child = module.rpartition(".")
        layer = pieces.build(model.get_submodule(module), dtype, device, threshold)
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        del groups[module]


def _linear_groups(model, placements, config: ModelConfig, where: str) -> dict[str, FusedPieces]:
    """Our Linear name -> its FusedPieces, for every Linear the checkpoint fills (a tied head is the embedding)."""
    by_module: dict[str, list] = {}
    for proj, p in sorted(placements.items(), key=lambda kv: kv[1].row):
        if config.tie_word_embeddings and p.module == "lm_head":
            continue
        # a column cut (o_proj, down_proj) sizes the input; such a Linear is one projection, all its rows
        by_module.setdefault(p.module, []).append((proj, p.cut.size if p.cut.dim == 0 else None))
    groups = {}
    for name, module in model.named_modules():
        short = name.rpartition(".")[2]
        if short in by_module and isinstance(module, nn.Linear):
            projs = by_module[short]
            rows = [module.out_features if r is None else r for _, r in projs]
            groups[name] = FusedPieces(name, [p for p, _ in projs], rows, module.in_features, where)
    return groups
