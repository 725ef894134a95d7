"""Reading a QuantState's serialized items (``QuantState.from_dict``), checking every one of them: a
checkpoint with a missing or wrong entry fails here, naming the entry and what was expected, instead of
dequantizing to garbage later."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..ops.quant_common import BLOCKSIZES, QUANT_TYPES_4BIT
from .state import DTYPE_NAMES, PACKED_PREFIX, QuantState, unpack_tensor_to_dict

REQUIRED_KEYS = ("quant_type", "absmax", "blocksize", "quant_map", "dtype", "shape")
NESTED_KEYS = ("nested_absmax", "nested_blocksize", "nested_quant_map", "nested_dtype", "nested_offset")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _split_keys(qs_dict: Mapping) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """Items by their last dotted component (prefixes stripped), and the packed blobs apart."""
    items, blobs, origin = {}, [], {}
    for key, value in qs_dict.items():
        if not isinstance(key, str):
            raise ValueError(f"qs_dict: expected string keys, got {key!r}")
        short = key.split(".")[-1]
        if short.startswith(PACKED_PREFIX):
            blobs.append((key, value))
            continue
        if short in items:
            raise ValueError(f"qs_dict: {origin[short]!r} and {key!r} are both {short!r}: expected the items of one "
                             f"QuantState")
        items[short], origin[short] = value, key
    return items, blobs


def _unpack_blob(items: dict, blobs: list) -> None:
    if len(blobs) > 1:
        raise ValueError(f"qs_dict: expected one packed quant_state item, got {[k for k, _ in blobs]}")
    key, blob = blobs[0]
    quant_type = key.split(".")[-1].removeprefix(PACKED_PREFIX)
    if quant_type not in QUANT_TYPES_4BIT:
        raise ValueError(f"{key}: expected a key ending in one of "
                         f"{', '.join('quant_state.' + k for k in QuantState.valid_qs_type_keys)}")
    for name, value in unpack_tensor_to_dict(blob, key).items():
        if name in items:
            raise ValueError(f"{key}: {name!r} is both in the packed JSON and an item of its own")
        items[name] = value
    if items.get("quant_type") != quant_type:
        raise ValueError(f"{key}: expected its JSON to hold quant_type {quant_type!r} (the key's), "
                         f"got {items.get('quant_type')!r}")


def _check_tensor(items: dict, name: str, dtype: torch.dtype, numel: int | None) -> None:
    value = items[name]
    ok = isinstance(value, torch.Tensor) and value.dtype == dtype and value.dim() == 1
    if not ok or (numel is not None and value.numel() != numel):
        shape = f"({numel},)" if numel is not None else "[n]"
        raise ValueError(f"{name}: expected a {dtype} tensor of shape {shape}, got {_describe(value)}")


def _check_int_in(items: dict, name: str, allowed) -> None:
    value = items[name]
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, allowed))}, got {_describe(value)}")


def _check_dtype_name(items: dict, name: str) -> None:
    if items[name] not in DTYPE_NAMES:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, DTYPE_NAMES))}, got {_describe(items[name])}")


def parse_quant_state_dict(qs_dict) -> dict:
    """The checked items of one QuantState by short name, blob unpacked.  Raises ValueError naming the
    first bad or missing item."""
    if not isinstance(qs_dict, Mapping):
        raise ValueError(f"qs_dict: expected a dict of one QuantState's items, got {type(qs_dict).__name__}")
    items, blobs = _split_keys(qs_dict)
    if blobs:
        _unpack_blob(items, blobs)
    elif "quant_type" not in items:
        raise ValueError("qs_dict: expected packed items (a 'quant_state.bitsandbytes__nf4' or '__fp4' tensor) or "
                         f"unpacked ones ('quant_type', 'absmax', ...), found neither among {sorted(qs_dict)}")
    unknown = sorted(set(items) - set(REQUIRED_KEYS) - set(NESTED_KEYS))
    if unknown:
        raise ValueError(f"qs_dict: unexpected items {unknown}; expected {list(REQUIRED_KEYS + NESTED_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in items]
    if missing:
        raise ValueError(f"qs_dict: missing {missing}; expected all of {list(REQUIRED_KEYS)}")
    nested = [k for k in NESTED_KEYS if k in items]
    if nested and len(nested) != len(NESTED_KEYS):
        raise ValueError(f"qs_dict: missing {[k for k in NESTED_KEYS if k not in items]}: double quantization "
                         f"needs all of {list(NESTED_KEYS)}")

    quant_type = items["quant_type"]
    if quant_type is not None and quant_type not in QUANT_TYPES_4BIT:
        raise ValueError(f"quant_type: expected 'nf4' or 'fp4' (or None for an 8-bit state), "
                         f"got {_describe(quant_type)}")
    _check_int_in(items, "blocksize", BLOCKSIZES)
    _check_dtype_name(items, "dtype")
    shape = items["shape"]
    if shape is not None and (not isinstance(shape, (list, tuple, torch.Size))
                              or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ValueError(f"shape: expected a list of non-negative ints (or None), got {_describe(shape)}")
    blocks = -(-math.prod(shape) // items["blocksize"]) if shape is not None else None
    _check_tensor(items, "absmax", torch.uint8 if nested else torch.float32, blocks)
    _check_tensor(items, "quant_map", torch.float32, 16 if quant_type is not None else 256)
    if nested:
        _check_int_in(items, "nested_blocksize", BLOCKSIZES)
        _check_dtype_name(items, "nested_dtype")
        _check_tensor(items, "nested_absmax", torch.float32, -(-items["absmax"].numel() // items["nested_blocksize"]))
        _check_tensor(items, "nested_quant_map", torch.float32, 256)
        offset = items["nested_offset"]
        if isinstance(offset, torch.Tensor) and offset.numel() == 1:
            items["nested_offset"] = offset = float(offset.item())
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise ValueError(f"nested_offset: expected a number (the mean subtracted from absmax), "
                             f"got {_describe(offset)}")
    return items
