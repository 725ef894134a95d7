"""Decoding GGUF's Q4 codes (Q4_0 / Q4_1 / Q4_K: the table ``(q - 8) / 8``) by arithmetic instead of a table
lookup, on NVIDIA: the GEMV's dot of a word of 8 codes and the GEMM's pair decoder, as inline PTX.

A code that is its own integer needs no table: OR-ing a nibble under the exponent of a 16-bit "magic" number gives
magic + q (or magic + 16 q for the nibble above), and one 16-bit pair FMA takes that to (q - 8) / 8 exactly (every
intermediate is representable).  Per word of 8 codes that is 4 ``lop3`` (+ 1 or 3 shifts, + 2 byte permutes in the
pair decoder) on the integer pipe against ~22 for ``_decode_4bit``'s table lookup, which is what bounds the table
GEMV (Hopper's integer pipe runs at half the FP32 rate: docs/perf/2026-12-05-gpu-s15.md); the FMAs go to the FMA
pipe, which the table GEMV leaves mostly idle.  ``tests/test_decode_4bit_ptx.py`` runs this PTX in an interpreter.
"""

import os

import torch
import triton
import triton.language as tl

from ._decode_4bit import _WIDEN_BF16, _WIDEN_F16
from .code_lut import UNCACHED, cached_per_tensor

LINEAR_CODE = tuple((q - 8) / 8 for q in range(16))  # must equal quant/gguf_4bit.code_table("q4")
# On by default (first run on a GPU, an H100: the GPU tests pass and the Q4_K GEMV and 16-row GEMM are faster than
# with the table, docs/perf/2026-12-05-gpu-s16.md); ANYGPU_LINEAR_4BIT=0 falls back to the table decoder.
LINEAR_DECODE = os.environ.get("ANYGPU_LINEAR_4BIT", "1") != "0"
_LINEAR_SEEN: dict = {}  # code_lut.cached_per_tensor's entries: id(table) -> (weak reference, version, answer)
_LINEAR_SEEN_MAX = 4096  # a model has a table per layer: hundreds


def linear_code(code: torch.Tensor) -> bool:
    """Whether the 16-entry table ``code`` is ``LINEAR_CODE`` (the launchers then take the arithmetic decoder).
    Compared once per table tensor (a device read) and remembered while that tensor lives unmodified; a table
    first seen during CUDA-graph capture, where no read is allowed, gets the table decoder, which is always right
    (the engine runs every layer eagerly before it captures)."""
    if not LINEAR_DECODE:
        return False

    def compare():
        if code.is_cuda and torch.cuda.is_current_stream_capturing():
            return UNCACHED
        return torch.equal(code.cpu(), torch.tensor(LINEAR_CODE, dtype=code.dtype))
    return bool(cached_per_tensor(_LINEAR_SEEN, code, id(code), compare, limit=_LINEAR_SEEN_MAX))


# Per dtype: the magic (1024.0 fp16 / 128.0 bf16, whose lowest mantissa bit is worth 1), the FMA taking magic + q
# to (q - 8) / 8, and for fp16 the FMA taking magic + 16 q (the upper nibble of a byte left in place: fp16's
# mantissa has room for it, bf16's 7 bits do not, so bf16 shifts that nibble down first).
_LIN = {"f16": {"magic": "0x64006400", "mul": "0x30003000", "add": "0xD808D808",  # x 1/8 - 129
                "mul16": "0x20002000", "add16": "0xC880C880"},  # x 1/128 - 9
        "bf16": {"magic": "0x43004300", "mul": "0x3E003E00", "add": "0xC188C188"}}  # x 1/8 - 17


def _linear_consts(t: str) -> str:
    """The constants ``_linear_pairs`` uses, set once per asm block."""
    c = _LIN[t]
    lines = [f"mov.b32 mg, {c['magic']};", "mov.b32 nm, 0x000F000F;", f"mov.b32 ml, {c['mul']};",
             f"mov.b32 ad, {c['add']};"]
    if t == "f16":
        lines += ["mov.b32 nh, 0x00F000F0;", f"mov.b32 ml16, {c['mul16']};", f"mov.b32 ad16, {c['add16']};"]
    return "\n        ".join([""] + lines)


def _linear_pairs(t: str, src: str, outs: tuple) -> str:
    """``outs`` = the decoded 16-bit pairs of ``src``'s nibbles at bits 0 and 16 (low nibbles of its bytes 0 and
    2), 4 and 20, 8 and 24, 12 and 28 (fp16: only the first two; then src >> 8 gives the others), with the
    constants of ``_linear_consts(t)``."""
    lines = []
    if t == "f16":
        for i, o in enumerate(outs):
            s = src if i < 2 else "s8"
            if i == 2:
                lines.append(f"shr.u32 s8, {src}, 8;")
            if i % 2 == 0:
                lines += [f"lop3.b32 {o}, {s}, nm, mg, 0xEA;", f"fma.rn.f16x2 {o}, {o}, ml, ad;"]
            else:
                lines += [f"lop3.b32 {o}, {s}, nh, mg, 0xEA;", f"fma.rn.f16x2 {o}, {o}, ml16, ad16;"]
    else:
        for i, o in enumerate(outs):
            s = src
            if i:
                lines.append(f"shr.u32 s8, {src}, {4 * i};")
                s = "s8"
            lines += [f"lop3.b32 {o}, {s}, nm, mg, 0xEA;", f"fma.rn.bf16x2 {o}, {o}, ml, ad;"]
    return "\n        ".join([""] + lines)


_LIN_REGS = ".reg .b32 mg, nm, nh, ml, ad, ml16, ad16, s8;"

# One word's dot: its decoded pairs are elements (1, 5), (0, 4), (3, 7), (2, 6) (bitsandbytes' order puts
# element 2i in the high nibble of byte i), so x arrives in those pairs ($1..$4, from ``_linear_x_pairs``).
_DOT8_LINEAR = ("""
        {
        .reg .b32 p0, p1, p2, p3, acc, lo, hi, z;
        .reg .b16 h0, h1;
        """ + _LIN_REGS + """
        mov.b32 z, 0x80008000;{decode}
        fma.rn.{t}x2 acc, p0, $1, z;
        fma.rn.{t}x2 acc, p1, $2, acc;
        fma.rn.{t}x2 acc, p2, $3, acc;
        fma.rn.{t}x2 acc, p3, $4, acc;
        {widen}
        add.f32 $0, lo, hi;
        }
""")


def _dot8_linear_ptx(t: str, widen: str) -> str:
    decode = _linear_consts(t) + _linear_pairs(t, "$5", ("p0", "p1", "p2", "p3"))
    return _DOT8_LINEAR.replace("{decode}", decode).replace("{t}", t).replace("{widen}", widen)


DOT8_LINEAR_F16 = tl.constexpr(_dot8_linear_ptx("f16", _WIDEN_F16))
DOT8_LINEAR_BF16 = tl.constexpr(_dot8_linear_ptx("bf16", _WIDEN_BF16))

# x's pairs (x0|x1, x2|x3, x4|x5, x6|x7) of a word to the linear decoder's (x1|x5, x0|x4, x3|x7, x2|x6).
X_PAIRS_LINEAR = tl.constexpr("""
        prmt.b32 $0, $4, $6, 0x7632;
        prmt.b32 $1, $4, $6, 0x5410;
        prmt.b32 $2, $5, $7, 0x7632;
        prmt.b32 $3, $5, $7, 0x5410;
""")


@triton.jit
def _linear_x_pairs(xa, xb, xc, xd):
    """NVIDIA only: a word's activation pairs in the order ``_dot8_linear`` takes them (once per step, for every
    row of the program)."""
    return tl.inline_asm_elementwise(X_PAIRS_LINEAR, "=r,=r,=r,=r,r,r,r,r", [xa, xb, xc, xd],
                                     dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def _dot8_linear(w, x15, x04, x37, x26, BF16: tl.constexpr):
    """NVIDIA only: ``_dot8`` for the linear table ``LINEAR_CODE``, decoded by arithmetic (no table registers)."""
    if BF16:
        return tl.inline_asm_elementwise(DOT8_LINEAR_BF16, "=f,r,r,r,r,r", [x15, x04, x37, x26, w],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(DOT8_LINEAR_F16, "=f,r,r,r,r,r", [x15, x04, x37, x26, w],
                                     dtype=tl.float32, is_pure=True, pack=1)


# The pair decoder's linear form: bytes 0 and 1 (then 2 and 3) spread into the two 16-bit lanes by a byte
# permute, whose low nibbles (odd elements) and high nibbles (even elements) then decode as above.
def _decode_pairs_linear(t: str) -> str:
    return ("""
        {
        .reg .b32 s01, s23;
        """ + _LIN_REGS + """
        prmt.b32 s01, $4, $4, 0x1100;
        prmt.b32 s23, $4, $4, 0x3322;"""
            + _linear_consts(t) + _linear_pairs(t, "s01", ("$2", "$0")) + _linear_pairs(t, "s23", ("$3", "$1"))
            + """
        }
""")


DECODE_PAIRS_LINEAR_F16 = tl.constexpr(_decode_pairs_linear("f16"))
DECODE_PAIRS_LINEAR_BF16 = tl.constexpr(_decode_pairs_linear("bf16"))


@triton.jit
def _decode_pairs_linear_codes(packed, BF16: tl.constexpr):
    """NVIDIA only: ``_decode_pairs`` for the linear table ``LINEAR_CODE`` (no table registers)."""
    if BF16:
        hi, lo = tl.inline_asm_elementwise(DECODE_PAIRS_LINEAR_BF16, "=r,=r,=r,=r,r", [packed],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        hi, lo = tl.inline_asm_elementwise(DECODE_PAIRS_LINEAR_F16, "=r,=r,=r,=r,r", [packed],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return hi, lo
