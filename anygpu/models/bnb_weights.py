"""One engine Linear from a bitsandbytes checkpoint's stored pieces, without re-quantizing.

The engine fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (one GEMM instead of three or two);
a checkpoint stores each projection apart, with its own quant state.  ``FusedPieces`` gathers the tensors of
one engine Linear as the checkpoint's stream brings them (``add``), says when every piece is in (``complete``),
and ``build`` makes the layer:

- 4-bit (a packed ``weight`` with ``absmax``, ``quant_map``, ``quant_state.bitsandbytes__*`` and, double
  quantized, ``nested_absmax`` / ``nested_quant_map``): one piece keeps its state as stored, nested or not.  Pieces
  of a fused Linear are concatenated: the packed bytes end to end (the blocks run over the row-major flattened
  weight, so stacking rows stacks blocks, as long as each piece fills whole blocks), and their fp32 absmax.  A
  nested absmax is de-nested first (``dequantize_blockwise(absmax) + offset``, bitsandbytes' own step before
  every matmul), because each piece has its own offset and one state holds one: the scales are the ones
  bitsandbytes computes with, the fused layer's statistics just take 32 bits each instead of 8.
- 8-bit (int8 ``weight`` and its ``SCB`` row scales; ``weight_format`` checked): rows and scales stack exactly.
- full precision (a module kept out of quantization, ``llm_int8_skip_modules``): copied in the model's dtype.  A
  fused Linear whose projections are stored in different formats (v_proj skipped, q and k not) runs in full
  precision, its quantized pieces dequantized (bitsandbytes' dequantization, exact; nothing re-quantized).
"""

from __future__ import annotations

import json

import torch
from torch import nn

from ..nn import Linear4bit, Linear8bitLt
from ..quant import QuantState, dequantize_4bit, dequantize_blockwise, int8_vectorwise_dequant

BLOB = "weight.quant_state.bitsandbytes__"
ITEMS_4BIT = ("weight", "weight.absmax", "weight.quant_map")
NESTED_ITEMS = ("weight.nested_absmax", "weight.nested_quant_map")


class FusedPieces:
    """The checkpoint tensors of one engine Linear (``module``, e.g. ``layers.0.self_attn.qkv_proj``), made of
    the projections ``pieces`` (HF names, e.g. q_proj, k_proj, v_proj), each ``rows[i]`` output rows, all
    ``in_features`` wide.  ``where``: the checkpoint, for errors."""

    def __init__(self, module: str, pieces: list[str], rows: list[int], in_features: int, where: str):
        self.module, self.pieces, self.rows, self.in_features, self.where = module, pieces, rows, in_features, where
        self.items: dict[str, dict[str, torch.Tensor]] = {p: {} for p in pieces}
        self.names: dict[str, str] = {}  # piece -> the checkpoint name of its weight, for errors

    def add(self, piece: str, item: str, name: str, tensor: torch.Tensor) -> None:
        if item in self.items[piece]:
            raise ValueError(f"{self.where}: {name}: stored twice")
        self.items[piece][item] = tensor
        if item == "weight":
            self.names[piece] = name

    def _kind(self, piece: str) -> str | None:
        """"4bit", "8bit", "float", or None while its weight has not come."""
        weight = self.items[piece].get("weight")
        if weight is None:
            return None
        if weight.dtype == torch.int8:
            return "8bit"
        if any(k.startswith(BLOB) for k in self.items[piece]) or (weight.dim() == 2 and weight.shape[1] == 1
                                                                  and self.in_features != 1):
            return "4bit"
        return "float"

    def _missing(self, piece: str) -> list[str]:
        kind, items = self._kind(piece), self.items[piece]
        if kind is None:
            return ["weight"]
        if kind == "8bit":
            return [] if "SCB" in items else ["SCB"]
        if kind == "float":
            return []
        missing = [i for i in ITEMS_4BIT if i not in items]
        blob = [k for k in items if k.startswith(BLOB)]
        if not blob:
            return missing + [BLOB + "<nf4|fp4>"]
        if "nested_blocksize" in _blob_fields(items[blob[0]], f"{self.where}: {self.names.get(piece)}.{blob[0]}"):
            missing += [i for i in NESTED_ITEMS if i not in items]
        return missing

    def complete(self) -> bool:
        return all(not self._missing(p) for p in self.pieces)

    def missing(self) -> list[str]:
        return [f"{p}.{m}" for p in self.pieces for m in self._missing(p)]

    def build(self, old: nn.Linear, dtype: torch.dtype, device: torch.device, threshold: float) -> nn.Module:
        """The layer standing in for ``old`` (the model's meta nn.Linear; its bias, already loaded, is kept)."""
        kinds = {p: self._kind(p) for p in self.pieces}
        kind = kinds[self.pieces[0]]
        if len(set(kinds.values())) > 1:
            # Some projections kept in full precision (llm_int8_skip_modules naming v_proj, say): the fused layer
            # runs in full precision, the quantized pieces dequantized exactly as bitsandbytes would.
            kind = "float"
        if kind == "4bit":
            layer = self._linear4bit(dtype, device)
        elif kind == "8bit":
            layer = self._linear8bit(device, threshold)
        else:
            weight = torch.cat([self._float_weight(p, kinds[p]).to(dtype) for p in self.pieces]).to(device)
            layer = nn.Linear(self.in_features, sum(self.rows), bias=False, device="meta", dtype=dtype)
            layer.weight = nn.Parameter(weight, requires_grad=False)
        if old.bias is not None:
            layer.bias = old.bias
        return layer

    def _float_weight(self, piece: str, kind: str) -> torch.Tensor:
        weight, rows = self.items[piece]["weight"], self.rows[self.pieces.index(piece)]
        if kind == "4bit":
            state = self._states([piece])[0]
            return dequantize_4bit(weight, state).float()
        if kind == "8bit":
            self._check_int8(piece)
            return int8_vectorwise_dequant(weight, self.items[piece]["SCB"].reshape(-1).float())
        if tuple(weight.shape) != (rows, self.in_features):
            raise ValueError(f"{self.where}: {self.names[piece]}: shape {tuple(weight.shape)}, expected "
                             f"{(rows, self.in_features)}")
        return weight

    def _states(self, pieces: list[str] | None = None) -> list[QuantState]:
        pieces = pieces or self.pieces
        states = []
        for piece in pieces:
            rows = self.rows[self.pieces.index(piece)]
            name = self.names[piece]
            stats = {k.removeprefix("weight."): v for k, v in self.items[piece].items() if k != "weight"}
            try:
                state = QuantState.from_dict(stats, device="cpu")
            except ValueError as e:
                raise ValueError(f"{self.where}: {name}: its quant state: {e}") from None
            if tuple(state.shape) != (rows, self.in_features):
                raise ValueError(f"{self.where}: {name}: its quant state says shape {tuple(state.shape)}, expected "
                                 f"{(rows, self.in_features)} from config.json")
            states.append(state)
        first = states[0]
        for piece, state in zip(pieces[1:], states[1:]):
            for field in ("quant_type", "blocksize", "dtype"):
                if getattr(state, field) != getattr(first, field):
                    raise ValueError(f"{self.where}: {self.names[piece]}: {field} {getattr(state, field)} differs "
                                     f"from {self.names[pieces[0]]}'s {getattr(first, field)}; the two run "
                                     f"as one fused layer ({self.module})")
        return states

    def _linear4bit(self, dtype: torch.dtype, device: torch.device) -> Linear4bit:
        states = self._states()
        packed = [self.items[p]["weight"] for p in self.pieces]
        storages = {t.dtype for t in packed}
        if len(storages) > 1:
            raise ValueError(f"{self.where}: {self.module}: packed weights stored as {sorted(map(str, storages))}; "
                             "they run as one fused layer, so they need one storage dtype")
        first = states[0]
        if len(states) == 1:
            state, weight = first, packed[0]
        else:
            for piece, rows in zip(self.pieces, self.rows):
                if rows * self.in_features % first.blocksize:
                    raise ValueError(f"{self.where}: {self.names[piece]}: {rows} x {self.in_features} weights are "
                                     f"not whole blocks of {first.blocksize}, so it cannot be fused into "
                                     f"{self.module} without re-quantizing")
            absmax = torch.cat([_plain_absmax(s) for s in states])
            state = QuantState(absmax=absmax, shape=torch.Size((sum(self.rows), self.in_features)), code=first.code,
                               blocksize=first.blocksize, quant_type=first.quant_type, dtype=first.dtype)
            weight = torch.cat([t.reshape(-1).view(torch.uint8) for t in packed]).view(packed[0].dtype)[:, None]
        layer = Linear4bit(self.in_features, sum(self.rows), bias=False, compute_dtype=dtype,
                           compress_statistics=state.nested, quant_type=state.quant_type,
                           quant_storage=weight.dtype, device="meta", blocksize=state.blocksize)
        stats = {f"weight.{k}": v.to(device) for k, v in state.as_dict(packed=True).items()}
        layer.load_state_dict({"weight": weight.to(device), **stats}, assign=True)
        return layer

    def _check_int8(self, piece: str) -> None:
        weight, scb, rows = self.items[piece]["weight"], self.items[piece]["SCB"], self.rows[self.pieces.index(piece)]
        if tuple(weight.shape) != (rows, self.in_features) or scb.numel() != rows:
            raise ValueError(f"{self.where}: {self.names[piece]}: int8 weight {tuple(weight.shape)} with "
                             f"{scb.numel()} SCB scales, expected {(rows, self.in_features)} and {rows}")

    def _linear8bit(self, device: torch.device, threshold: float) -> Linear8bitLt:
        weights, scales = [], []
        for piece in self.pieces:
            self._check_int8(piece)
            weights.append(self.items[piece]["weight"])
            scales.append(self.items[piece]["SCB"].reshape(-1).float())
        layer = Linear8bitLt(self.in_features, sum(self.rows), bias=False, has_fp16_weights=False,
                             threshold=threshold, device="meta")
        layer.load_state_dict({"weight": torch.cat(weights).to(device), "SCB": torch.cat(scales).to(device)},
                              assign=True)
        return layer


def check_weight_format(name: str, tensor: torch.Tensor, where: str) -> None:
    """An 8-bit layer's layout marker (it may come after the layer is built): only row-major (0) is ever saved."""
    if tensor.numel() != 1 or int(tensor.reshape(-1)[0]) != 0:
        raise ValueError(f"{where}: {name}: expected weight_format 0 (row-major int8), got {tensor.tolist()}")


def _plain_absmax(state: QuantState) -> torch.Tensor:
    if not state.nested:
        return state.absmax.float()
    return dequantize_blockwise(state.absmax, state.state2).float() + state.offset


def _blob_fields(blob: torch.Tensor, where: str) -> dict:
    try:
        fields = json.loads(bytes(blob.reshape(-1).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: expected JSON text in a uint8 tensor ({e})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(fields).__name__}")
    return fields


def unpacked_shapes(shapes: dict[str, tuple[int, ...]], nbytes: dict[str, int], expected: dict[str, tuple],
                    where: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor shapes with each packed 4-bit weight (one with quant-state items ``<name>.*`` next to
    it) given as the [out, in] it packs, once its byte count (``nbytes``) is checked against that shape: so the
    checks of ``shape_check`` apply to quantized checkpoints too.  ``expected``: ``shape_check.expected_shapes``."""
    out = dict(shapes)
    packed = {name[: name.index(".weight.") + len(".weight")] for name in shapes if ".weight." in name}
    for name in shapes:
        if name not in packed or name not in expected:
            continue
        full = expected[name][0]
        want = (full[0] * full[1] + 1) // 2
        if nbytes[name] != want:
            raise ValueError(f"{where}: tensor {name!r} holds {nbytes[name]} bytes of packed 4-bit weights, but "
                             f"config.json gives it shape {full} ({expected[name][1]}): {want} bytes")
        out[name] = full
    return out
