"""A small interpreter for the straight-line inline PTX of the 4-bit decoders (``anygpu/kernels/_decode_4bit.py``),
so that their text is checked on a machine without a GPU: 32-bit registers, the integer and byte-permute
instructions they use, and fp16/bf16 pair FMAs rounded to nearest even.  Only what those strings use is here;
anything else raises, so a decoder that grows an instruction grows this file too.
"""

from __future__ import annotations

import math
import re
import struct

_SIG_BITS = {"f16": 11, "bf16": 8}
_EXP_MIN = {"f16": -14, "bf16": -126}


def _to_float(bits: int, t: str) -> float:
    if t == "bf16":
        return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def _round(v: float, t: str) -> int:
    """``v`` rounded to nearest even in fp16 / bf16 (normal numbers and zero; the tests stay in that range)."""
    if v == 0:
        return 0x8000 if math.copysign(1, v) < 0 else 0
    m, e = math.frexp(v)  # v = m * 2**e, 0.5 <= |m| < 1
    if e - 1 < _EXP_MIN[t]:
        raise ValueError(f"subnormal result {v} in {t}: outside what this interpreter models")
    r = round(m * 2 ** _SIG_BITS[t]) / 2 ** _SIG_BITS[t] * 2.0 ** e
    if t == "bf16":
        return struct.unpack("<I", struct.pack("<f", r))[0] >> 16
    return struct.unpack("<H", struct.pack("<e", r))[0]


def _prmt(a: int, b: int, sel: int) -> int:
    src = a | (b << 32)
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (s & 7))) & 0xFF
        if s & 8:  # sign mode: the selected byte's top bit, replicated
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    # PTX's immLut is F(0xF0, 0xCC, 0xAA): the result for input bits (a, b, c) is lut's bit a*4 + b*2 + c.
    return sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i for i in range(32))


def run(ptx: str, operands: dict[int, int]) -> dict[int, int | float]:
    """Run ``ptx`` with its ``$i`` operands given as 32-bit ints; returns every ``$i`` after the run (``.f32``
    results as floats)."""
    regs: dict[str, int | float] = {f"${i}": v for i, v in operands.items()}

    def val(tok: str) -> int | float:
        tok = tok.strip()
        if tok.lower().startswith("0x"):
            return int(tok, 16)
        if re.fullmatch(r"-?\d+", tok):
            return int(tok) & 0xFFFFFFFF
        return regs[tok]

    lines = [ln for ln in ptx.splitlines() if ln.strip() not in ("{", "}")]
    for stmt in (s.strip() for s in "\n".join(lines).split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        unpack = re.fullmatch(r"\{\s*(\w+),\s*(\w+)\s*\},\s*(\S+)", rest.strip())
        if op == "mov.b32" and unpack:  # a register's two 16-bit halves
            v = val(unpack.group(3))
            regs[unpack.group(1)], regs[unpack.group(2)] = v & 0xFFFF, (v >> 16) & 0xFFFF
            continue
        d, *args = (a.strip() for a in rest.split(","))
        if op == "mov.b32":
            regs[d] = val(args[0])
        elif op == "lop3.b32":
            regs[d] = _lop3(*(val(a) for a in args))
        elif op == "prmt.b32":
            regs[d] = _prmt(*(val(a) for a in args))
        elif op == "shr.u32":
            regs[d] = val(args[0]) >> val(args[1])
        elif op == "shl.b32":
            regs[d] = (val(args[0]) << val(args[1])) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[d] = val(args[0]) & val(args[1])
        elif op in ("fma.rn.f16x2", "fma.rn.bf16x2"):
            t = op.split(".")[2][:-2]
            a, b, c = (val(x) for x in args)
            lanes = [_round(_to_float(a >> s, t) * _to_float(b >> s, t) + _to_float(c >> s, t), t) for s in (0, 16)]
            regs[d] = lanes[0] | (lanes[1] << 16)
        elif op == "cvt.f32.f16":
            regs[d] = _to_float(val(args[0]), "f16")
        elif op == "add.f32":
            regs[d] = struct.unpack("<f", struct.pack("<f", _f32(val(args[0])) + _f32(val(args[1]))))[0]
        else:
            raise ValueError(f"unsupported instruction: {stmt}")
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def _f32(v: int | float) -> float:
    if isinstance(v, float):
        return v
    return struct.unpack("<f", struct.pack("<I", v & 0xFFFFFFFF))[0]
