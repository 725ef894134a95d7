"""``QuantState``: what it takes to undo a quantization, with bitsandbytes' fields and serialization.

Checkpoints written by bitsandbytes (and transformers, vLLM, TGI on top of it) store a 4-bit weight ``p``
as ``p.weight`` (packed codes) plus ``p.weight.absmax``, ``p.weight.quant_map``, for double quantization
``p.weight.nested_absmax`` / ``nested_quant_map``, and the non-tensor fields as a uint8 tensor holding
JSON under ``p.weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``).  ``as_dict(packed=True)`` writes
exactly that (same keys, same JSON text) and ``from_dict`` reads it, prefixed or not, packed or not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from ..ops.quant_common import QUANT_TYPES_4BIT

DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PACKED_PREFIX = "bitsandbytes__"  # the blob's key: "quant_state.bitsandbytes__nf4"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")  # "bfloat16": what bitsandbytes writes


def pack_dict_to_tensor(items: dict) -> torch.Tensor:
    """JSON (default separators, insertion order) as a uint8 CPU tensor: safetensors stores only tensors."""
    return torch.tensor(list(json.dumps(items).encode("utf-8")), dtype=torch.uint8)


def unpack_tensor_to_dict(blob: torch.Tensor, name: str = "quant_state") -> dict:
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        got = f"{blob.dtype} {tuple(blob.shape)}" if isinstance(blob, torch.Tensor) else type(blob).__name__
        raise ValueError(f"{name}: expected a 1-D uint8 tensor of JSON text, got {got}")
    try:
        items = json.loads(bytes(blob.cpu().tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}: expected UTF-8 JSON text, could not decode it ({e})") from None
    if not isinstance(items, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(items).__name__}")
    return items


class QuantState:
    """Quantization state, field for field bitsandbytes' (``nested`` is ``state2 is not None``).

    4-bit: absmax fp32 [blocks] (uint8 when nested), shape of the original tensor, code = the 16-entry
    table, dtype of the original, blocksize, quant_type "nf4" | "fp4"; nested (double quantization):
    offset (0-dim fp32, the mean subtracted before quantizing absmax) and state2, the 8-bit state of
    absmax.  8-bit blockwise states have shape and quant_type None and code = the 256-entry map.
    """

    valid_quant_types = QUANT_TYPES_4BIT
    valid_qs_type_keys = [f"{PACKED_PREFIX}{t}" for t in QUANT_TYPES_4BIT]
    valid_qs_keys = ["absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state", "quant_type",
                     "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"]

    def __init__(self, absmax, shape=None, code=None, blocksize=None, quant_type=None, dtype=None, offset=None,
                 state2=None):
        self.absmax = absmax
        self.shape = shape
        self.code = code
        self.dtype = dtype
        self.blocksize = blocksize
        self.quant_type = quant_type
        self.offset = offset
        self.state2 = state2
        self.nested = state2 is not None

    def __getattr__(self, name: str):
        # FSDP resolves the state-dict key "...weight.quant_state.bitsandbytes__nf4" attribute by attribute.
        if name.startswith(PACKED_PREFIX) and name.removeprefix(PACKED_PREFIX) in QUANT_TYPES_4BIT:
            packed = self.as_dict(packed=True)
            if f"quant_state.{name}" in packed:
                return packed[f"quant_state.{name}"]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __getitem__(self, index):
        """The pre-QuantState list layout: [absmax, shape, dtype, blocksize, [offset, state2] | None, quant_type]."""
        nested = [self.offset, self.state2] if self.nested else None
        return [self.absmax, self.shape, self.dtype, self.blocksize, nested, self.quant_type][index]

    def __repr__(self) -> str:
        absmax = f"{self.absmax.dtype} {tuple(self.absmax.shape)}" if isinstance(self.absmax, torch.Tensor) else None
        return (f"QuantState(quant_type={self.quant_type!r}, blocksize={self.blocksize}, shape={self.shape}, "
                f"dtype={self.dtype}, absmax={absmax}, nested={self.nested})")

    def as_dict(self, packed: bool = False) -> dict[str, Any]:
        """bitsandbytes' serialization.  ``packed``: only tensors, the rest as the JSON blob (safetensors)."""
        items = {"quant_type": self.quant_type, "absmax": self.absmax, "blocksize": self.blocksize,
                 "quant_map": self.code, "dtype": _dtype_name(self.dtype),
                 "shape": tuple(self.shape) if self.shape is not None else None}
        if self.nested:
            items.update({
                "nested_absmax": self.state2.absmax,
                "nested_blocksize": self.state2.blocksize,
                # a copy: safetensors drops tensors that share memory, and every layer shares the map
                "nested_quant_map": self.state2.code.clone(),
                "nested_dtype": _dtype_name(self.state2.dtype),
                "nested_offset": float(self.offset.item()),
            })
        if not packed or self.quant_type is None:
            return items
        tensors = {k: v for k, v in items.items() if isinstance(v, torch.Tensor)}
        tensors[f"quant_state.{PACKED_PREFIX}{self.quant_type}"] = pack_dict_to_tensor(
            {k: v for k, v in items.items() if not isinstance(v, torch.Tensor)})
        return tensors

    @classmethod
    def from_dict(cls, qs_dict: Mapping[str, Any], device) -> QuantState:
        """Rebuild from ``as_dict`` output or a checkpoint's entries for one weight (keys may carry the
        module prefix, e.g. ``model.layers.0.mlp.down_proj.weight.absmax``).  The dict is not modified."""
        from ._state_dict import parse_quant_state_dict  # the checks, kept apart: they are half the code

        items = parse_quant_state_dict(qs_dict)
        device = torch.device(device)
        offset = state2 = None
        if "nested_absmax" in items:
            offset = torch.tensor(float(items["nested_offset"]), dtype=torch.float32, device=device)
            state2 = cls(absmax=items["nested_absmax"].to(device), blocksize=items["nested_blocksize"],
                         code=items["nested_quant_map"].to(device), dtype=DTYPE_NAMES[items["nested_dtype"]])
        shape = torch.Size(items["shape"]) if items["shape"] is not None else None
        return cls(absmax=items["absmax"].to(device), shape=shape, code=items["quant_map"].to(device),
                   blocksize=items["blocksize"], quant_type=items["quant_type"],
                   dtype=DTYPE_NAMES[items["dtype"]], offset=offset, state2=state2)

    def to(self, device) -> QuantState:
        """Move every tensor to ``device``, in place (as bitsandbytes); returns self for chaining."""
        self.code = self.code.to(device)
        self.absmax = self.absmax.to(device)
        if self.nested:
            self.offset = self.offset.to(device)
            self.state2.absmax = self.state2.absmax.to(device)
            self.state2.code = self.state2.code.to(device)
        return self

    def __eq__(self, other) -> bool:
        if not isinstance(other, QuantState):
            return False
        return (_close(self.absmax, other.absmax) and self.shape == other.shape and _close(self.code, other.code)
                and self.dtype == other.dtype and self.blocksize == other.blocksize
                and self.quant_type == other.quant_type
                and (_close(self.offset, other.offset) if self.offset is not None and other.offset is not None
                     else self.offset is other.offset)
                and (self.state2 == other.state2 if self.state2 is not None and other.state2 is not None
                     else self.state2 is other.state2))

    __hash__ = None  # mutable, compared by value


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """bitsandbytes' comparison (allclose, atol 1e-6), without broadcasting or device errors."""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(torch.allclose(a, b, atol=1e-6))

