"""``read_header(path)``: a safetensors file's tensor table, checked against the file before anything trusts it.

    tensors = read_header("model-00001-of-00002.safetensors")   # {"model.norm.weight": TensorEntry(...), ...}

The format: 8 bytes (little-endian u64 N), N bytes of JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}``, then the data, offsets relative to its start.  The safetensors
library checks much of this too, but its errors do not name the file, and a lying length is read before it is
checked against anything.  Here every number is bounded by the file's own size before it is used: the header
length by ``MAX_HEADER_BYTES`` (the safetensors library's own limit) and the file size, each tensor's byte range
by the data section, its size by dtype x shape; and the tensors must tile the data section exactly, as the
library requires (so a file that passes here opens there).  Errors are ValueErrors naming the file and the
tensor.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100_000_000  # what safetensors itself accepts; real headers are well under 10 MB
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_DIMS = 8


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"tensor {dup!r} is listed twice")
    return dict(pairs)


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file (metadata left out), each checked; ValueError naming ``path`` if not."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header length {n} is over the {MAX_HEADER_BYTES}-byte limit "
                             "(a corrupt or non-safetensors file)")
        if 8 + n > size:
            raise ValueError(f"{path}: safetensors header length {n} runs past the end of the {size}-byte file "
                             "(truncated or corrupt)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, a duplicate name, absurd nesting
        raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header: expected a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: safetensors header: __metadata__: expected an object of strings")
    data_size = size - 8 - n
    tensors = {name: _entry(path, name, value, data_size) for name, value in header.items()}
    _check_tiling(path, tensors, data_size)
    return tensors


def _entry(path: Path, name: str, value, data_size: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object with dtype, shape and data_offsets, got {value!r:.100}")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{where}: dtype: expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r:.100}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ValueError(f"{where}: shape: expected a list of at most {MAX_DIMS} non-negative ints, "
                         f"got {shape!r:.100}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{where}: data_offsets: expected [begin, end] with 0 <= begin <= end, "
                         f"got {offsets!r:.100}")
    begin, end = offsets
    if end > data_size:
        raise ValueError(f"{where}: data_offsets [{begin}, {end}] run past the end of the data ({data_size} "
                         "bytes): the file is truncated or its header is corrupt")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != nbytes:
        raise ValueError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but {dtype} "
                         f"{tuple(shape)} needs {nbytes}")
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_tiling(path: Path, tensors: dict[str, TensorEntry], data_size: int) -> None:
    """No two tensors share bytes and no byte is left over: one tensor's end is the next one's begin."""
    at, previous = 0, None
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != at:
            what = "overlaps" if t.begin < at else "leaves a gap after"
            after = f"tensor {previous!r}" if previous else "the header"
            raise ValueError(f"{path}: tensor {name!r} (data_offsets [{t.begin}, {t.end}]) {what} {after}")
        at, previous = t.end, name
    if at != data_size:
        raise ValueError(f"{path}: the tensors cover {at} bytes of data, but the file holds {data_size}: "
                         "truncated, or trailing bytes after the last tensor")
