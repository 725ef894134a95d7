"""``read_gguf(path) -> GGUFFile``: a GGUF file's metadata and tensor table, parsed with every length bounded.

    f = read_gguf("model.Q4_K_M.gguf")
    f.metadata["general.architecture"]            # plain Python values (str, int, float, bool, lists)
    for t in f.tensors: t.name, t.type_name, t.shape, t.offset, t.nbytes    # shape: torch order (row length last)

Why not ``gguf.GGUFReader``: it keeps a numpy view per metadata item (two per token of a 49k vocabulary), which
holds far more memory than the file's own tokenizer bytes for as long as the reader lives, and a tensor whose
bytes do not fit its type fails inside it with a message that names neither the tensor nor the type.  Here
every count is checked against the bytes left in the file before anything is allocated, and each tensor's
byte size is checked against its type, shape and the file's end, naming the tensor.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..quant.gguf_blocks import BLOCK_SHAPES

# GGUF's value types: id -> (struct code, size); 8 = string, 9 = array.
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
            7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
# ggml type ids (gguf.constants.GGMLQuantizationType) of the types the loader knows.
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16"}
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # torch order: GGUF lists ne0 (the row length) first
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type_id, f"type id {self.type_id}")


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict
    tensors: list[TensorInfo]
    data_start: int


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: not a readable GGUF file (truncated: {what} needs {n} bytes at offset "
                             f"{self.pos}, the file has {len(self.buf)})")

    def unpack(self, code: str, size: int, what: str):
        self.need(size, what)
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.unpack("Q", 8, what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.unpack(*_SCALARS[vtype], what)
        if vtype == 8:
            return self.string(what)
        if vtype == 9 and depth == 0:
            etype, count = self.unpack("I", 4, what), self.unpack("Q", 8, what)
            if etype in _SCALARS:
                code, size = _SCALARS[etype]
                self.need(count * size, what)  # before allocating: a count can claim anything
                out = list(struct.unpack_from(f"<{count}{code}", self.buf, self.pos))
                self.pos += count * size
                return out
            if etype == 8:
                self.need(count * 8, what)  # each string takes at least its 8-byte length
                return [self.string(what) for _ in range(count)]
            raise ValueError(f"{self.path}: not a readable GGUF file ({what}: arrays of value type {etype} are "
                             "not supported)")
        raise ValueError(f"{self.path}: not a readable GGUF file ({what}: unknown value type {vtype})")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header, metadata and tensor table of ``path``; ValueError naming the file (and the key or
    tensor) for anything malformed.  Tensor bytes are not read here."""
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            raise ValueError(f"{path}: not a readable GGUF file (it is empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf, path), size)


def _parse(c: _Cursor, size: int) -> GGUFFile:
    path = c.path
    if c.buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a readable GGUF file (no GGUF magic at the start)")
    c.pos = 4
    version = c.unpack("I", 4, "version")
    if version not in (2, 3):
        raise ValueError(f"{path}: not a readable GGUF file (version {version}; expected 2 or 3, little-endian)")
    n_tensors, n_kv = c.unpack("Q", 8, "tensor count"), c.unpack("Q", 8, "metadata count")
    # Each metadata item takes at least 12 bytes, each tensor entry at least 24: bounds both counts by the file.
    c.need(n_kv * 12 + n_tensors * 24, f"{n_kv} metadata items and {n_tensors} tensors")
    metadata = {}
    for _ in range(n_kv):
        key = c.string("a metadata key")
        metadata[key] = c.value(c.unpack("I", 4, key), key)
    infos = []
    for _ in range(n_tensors):
        name = c.string("a tensor name")
        n_dims = c.unpack("I", 4, name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions; expected 1 to {MAX_DIMS}")
        dims = [c.unpack("Q", 8, name) for _ in range(n_dims)]
        infos.append((name, tuple(reversed(dims)), c.unpack("I", 4, name), c.unpack("Q", 8, name)))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment is {alignment!r}; expected a power of two")
    data_start = -(-c.pos // alignment) * alignment
    tensors = [_tensor(path, size, data_start, *info) for info in infos]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{path}: tensor {dup} appears twice")
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise ValueError(f"{path}: tensor {a.name} ({a.type_name}, {a.nbytes} bytes at {a.offset}) overlaps "
                             f"tensor {b.name} at {b.offset}")
    return GGUFFile(path, version, metadata, tensors, data_start)


def _tensor(path: Path, size: int, data_start: int, name: str, shape: tuple[int, ...], type_id: int,
            rel: int) -> TensorInfo:
    type_name = TYPE_NAMES.get(type_id)
    if type_name is None:
        return TensorInfo(name, type_id, shape, data_start + rel, 0)  # refused by the loader, naming it
    block, bsize = BLOCK_SHAPES[type_name]
    if any(d < 1 for d in shape):
        raise ValueError(f"{path}: tensor {name} ({type_name}) has shape {list(shape)}; expected positive sizes")
    if shape[-1] % block:
        raise ValueError(f"{path}: tensor {name} ({type_name}) has rows of {shape[-1]} values, not a whole number "
                         f"of {type_name} blocks of {block}")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel // block * bsize
    offset = data_start + rel
    if offset + nbytes > size:
        raise ValueError(f"{path}: tensor {name} ({type_name}, shape {list(shape)}) needs {nbytes} bytes at offset "
                         f"{offset}, but the file ends at {size} (truncated?)")
    return TensorInfo(name, type_id, shape, offset, nbytes)
