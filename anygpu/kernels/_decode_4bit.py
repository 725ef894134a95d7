"""Decoding 4-bit weights inside kernels: block scales (with double quantization), table lookups, and
on NVIDIA a PTX decoder that turns 8 codes into 8 values with byte permutes on a table held in
registers.  Shared by the 4-bit matmul kernels (``matmul_4bit.py``).
"""

import os
import weakref

import torch
import triton
import triton.language as tl



@triton.jit
def _block_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, idx, mask,
                  NESTED: tl.constexpr):
    """fp32 absmax of the 4-bit blocks at ``idx`` (double quantization decoded on the fly)."""
    if NESTED:
        q = tl.load(absmax_ptr + idx, mask=mask, other=0).to(tl.int32)
        scale = tl.load(nested_code_ptr + q) * tl.load(nested_absmax_ptr + idx // 256, mask=mask, other=0.0)
        scale += tl.load(nested_offset_ptr)
    else:
        scale = tl.load(absmax_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return scale


@triton.jit
def _lookup(lut, idx):
    """code[idx] in lut's dtype, from the program's copy of the 16-entry table (``tl.gather``)."""
    return tl.gather(lut, idx.reshape(idx.numel), 0).reshape(idx.shape)


@triton.jit
def _tables(code_ptr, BF16: tl.constexpr = False):
    """The 16 code values (fp16, or bf16 with BF16) as 8 registers of bytes: t[i] holds the low bytes of
    codes 4i..4i+3, u[i] their high bytes."""
    r = tl.arange(0, 16)
    if BF16:
        v = tl.load(code_ptr + r).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        v = tl.load(code_ptr + r).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo = (v & 0xFF) << ((r % 4) * 8)
    hi = (v >> 8) << ((r % 4) * 8)
    g = r // 4
    return (tl.sum(tl.where(g == 0, lo, 0)), tl.sum(tl.where(g == 1, lo, 0)), tl.sum(tl.where(g == 2, lo, 0)),
            tl.sum(tl.where(g == 3, lo, 0)), tl.sum(tl.where(g == 0, hi, 0)), tl.sum(tl.where(g == 1, hi, 0)),
            tl.sum(tl.where(g == 2, hi, 0)), tl.sum(tl.where(g == 3, hi, 0)))


# The PTX both decoders share.  A word's 8 codes are looked up in two halves of 4 (low and high 16 bits):
# ``prmt`` picks bytes of the table's low and high halves by the codes' low 3 bits, a ``lop3`` chooses
# between them by bit 3 (turned into byte masks by prmt's sign mode), two more ``prmt`` interleave low and
# high bytes into 16-bit values, two to a register.  ``$w``: the word's operand; ``$t``..``$t+7``: the tables.
def _decode_setup(w: int | str) -> str:
    """``w``: the word's operand number, or a register's name."""
    w = f"${w}" if isinstance(w, int) else w
    return f"""
        shl.b32 b, {w}, 4;
        and.b32 sl, {w}, 0x7777;
        shr.u32 sh, {w}, 16;
        and.b32 sh, sh, 0x7777;
        prmt.b32 ml, b, {w}, 0xD9C8;
        prmt.b32 mh, b, {w}, 0xFBEA;"""


def _lookup_half(t: int, sel: str, mask: str, pairs: tuple, out: tuple = ("o0", "o1")) -> str:
    """out[0], out[1] = the half's 4 values as 16-bit pairs; ``pairs``: the interleave selectors (which element
    goes in the low and which in the high half of each register)."""
    return f"""
        prmt.b32 a0, ${t}, ${t + 1}, {sel};
        prmt.b32 a1, ${t + 2}, ${t + 3}, {sel};
        lop3.b32 ll, a0, a1, {mask}, 0xD8;
        prmt.b32 a0, ${t + 4}, ${t + 5}, {sel};
        prmt.b32 a1, ${t + 6}, ${t + 7}, {sel};
        lop3.b32 hh, a0, a1, {mask}, 0xD8;
        prmt.b32 {out[0]}, ll, hh, {pairs[0]};
        prmt.b32 {out[1]}, ll, hh, {pairs[1]};"""


NIBBLE_ORDER = ("0x5140", "0x7362")  # pairs (1, 0), (3, 2): the nibbles' order in the word
ELEMENT_ORDER = ("0x4051", "0x6273")  # pairs (0, 1), (2, 3): x's order, for 16-bit pair arithmetic


def _widen_f16(first: int) -> str:
    return f"""
        mov.b32 {{h0, h1}}, o0;
        mov.b32 {{h2, h3}}, o1;
        cvt.f32.f16 ${first}, h0;
        cvt.f32.f16 ${first + 1}, h1;
        cvt.f32.f16 ${first + 2}, h2;
        cvt.f32.f16 ${first + 3}, h3;"""


DECODE8 = tl.constexpr("""
        {
        .reg .b32 b, sl, sh, ml, mh, a0, a1, ll, hh, o0, o1;
        .reg .b16 h0, h1, h2, h3;""" + _decode_setup(8) + _lookup_half(9, "sl", "ml", NIBBLE_ORDER) + _widen_f16(0)
                       + _lookup_half(9, "sh", "mh", NIBBLE_ORDER) + _widen_f16(4) + """
        }
""")


@triton.jit
def _decode8(w, t0, t1, t2, t3, u0, u1, u2, u3):
    """NVIDIA only: the 8 codes of each int32 word to fp32 values, from the table in registers, with no
    memory access (the lookup above, then fp16 -> fp32).  ~3 instructions per element, where a lookup in
    memory costs 4-5.  Outputs are in nibble order: elements 1, 0, 3, 2, 5, 4, 7, 6."""
    return tl.inline_asm_elementwise(DECODE8, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r,r",
                                     [w, t0, t1, t2, t3, u0, u1, u2, u3],
                                     dtype=(tl.float32,) * 8, is_pure=True, pack=1)


# The 8 codes of a word looked up as in _decode8, interleaved into 16-bit pairs in element order (0,1),
# (2,3), (4,5), (6,7), multiplied with the matching pairs of activations in 16-bit pair arithmetic
# (4 products per lane summed in 16 bits), then the two lanes widened to fp32 and added.
_DOT8 = ("""
        {
        .reg .b32 b, sl, sh, ml, mh, a0, a1, ll, hh, o0, o1, acc, lo, hi, z;
        .reg .b16 h0, h1;
        mov.b32 z, 0x80008000;""" + _decode_setup(5) + _lookup_half(6, "sl", "ml", ELEMENT_ORDER) + """
        fma.rn.{t}x2 acc, o0, $1, z;
        fma.rn.{t}x2 acc, o1, $2, acc;""" + _lookup_half(6, "sh", "mh", ELEMENT_ORDER) + """
        fma.rn.{t}x2 acc, o0, $3, acc;
        fma.rn.{t}x2 acc, o1, $4, acc;
        {widen}
        add.f32 $0, lo, hi;
        }
""")
_WIDEN_F16 = "mov.b32 {h0, h1}, acc; cvt.f32.f16 lo, h0; cvt.f32.f16 hi, h1;"
_WIDEN_BF16 = "shl.b32 lo, acc, 16; and.b32 hi, acc, 0xFFFF0000;"  # bf16 -> fp32 is exact bit placement
# z = (-0.0, -0.0) as the first addend: x * y + (-0) is x * y exactly, sign of zero included.
DOT8_F16 = tl.constexpr(_DOT8.replace("{t}", "f16").replace("{widen}", _WIDEN_F16))
DOT8_BF16 = tl.constexpr(_DOT8.replace("{t}", "bf16").replace("{widen}", _WIDEN_BF16))


@triton.jit
def _dot8(w, xa, xb, xc, xd, t0, t1, t2, t3, u0, u1, u2, u3, BF16: tl.constexpr):
    """NVIDIA only: sum over the 8 codes of each int32 word of value x activation, in fp32 out.
    xa..xd: the word's activations as int32 pairs (x0|x1 << 16, x2|x3 << 16, ...).  Tables from
    ``_tables(code_ptr, BF16)``."""
    if BF16:
        return tl.inline_asm_elementwise(DOT8_BF16, "=f,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                         [xa, xb, xc, xd, w, t0, t1, t2, t3, u0, u1, u2, u3],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(DOT8_F16, "=f,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                     [xa, xb, xc, xd, w, t0, t1, t2, t3, u0, u1, u2, u3],
                                     dtype=tl.float32, is_pure=True, pack=1)


# Four bytes (8 codes) to 16-bit values with no widening, for tensor-core dots: with ``pack=4`` over uint8
# codes Triton hands the asm one register of 4 bytes, and the 16-bit results two to a register.  Outputs:
# the high nibbles' values (elements 0, 2, 4, 6 of the 8: bytes' first elements) as $0, $1 and the low
# nibbles' (elements 1, 3, 5, 7) as $2, $3.  32-bit operands are not packed: each table arrives as 4
# copies, so table i is operand 5 + 4 i.
def _lookup_pairs(sel: str, mask: str, hi_out: int, lo_out: int) -> str:
    t = [5 + 4 * i for i in range(8)]
    return f"""
        prmt.b32 a0, ${t[0]}, ${t[1]}, {sel};
        prmt.b32 a1, ${t[2]}, ${t[3]}, {sel};
        lop3.b32 ll, a0, a1, {mask}, 0xD8;
        prmt.b32 a0, ${t[4]}, ${t[5]}, {sel};
        prmt.b32 a1, ${t[6]}, ${t[7]}, {sel};
        lop3.b32 hh, a0, a1, {mask}, 0xD8;
        prmt.b32 ${hi_out}, ll, hh, 0x7351;
        prmt.b32 ${lo_out}, ll, hh, 0x6240;"""


DECODE_PAIRS = tl.constexpr("""
        {
        .reg .b32 b, sl, sh, ml, mh, a0, a1, ll, hh;""" + _decode_setup(4) + _lookup_pairs("sl", "ml", 0, 2)
                            + _lookup_pairs("sh", "mh", 1, 3) + """
        }
""")


PAIRS_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r" + ",r" * 32)


@triton.jit
def _decode_pairs(packed, t0, t1, t2, t3, u0, u1, u2, u3, BF16: tl.constexpr):
    """NVIDIA only: uint8 codes [..., B] to two tensors of 16-bit values (fp16, or bf16 with BF16), the high
    nibbles' (even elements) and the low nibbles' (odd elements), from the table in registers: about 2.5
    instructions per value and no conversion, ready for ``tl.dot``."""
    if BF16:
        hi, lo = tl.inline_asm_elementwise(DECODE_PAIRS, PAIRS_CONSTRAINTS, [packed, t0, t1, t2, t3, u0, u1, u2, u3],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        hi, lo = tl.inline_asm_elementwise(DECODE_PAIRS, PAIRS_CONSTRAINTS, [packed, t0, t1, t2, t3, u0, u1, u2, u3],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return hi, lo


# ---- linear codes: GGUF's Q4_0 / Q4_1 / Q4_K table, value (q - 8) / 8 -----------------------------------------
# A code that is its own integer needs no table: OR-ing a nibble under the exponent of a 16-bit "magic" number
# gives magic + q (or magic + 16 q for the nibble above), and one 16-bit pair FMA takes that to (q - 8) / 8
# exactly (every intermediate is representable).  Per word of 8 codes that is 4 ``lop3`` (+ 1 or 3 shifts, + 2
# byte permutes in the pair decoder) on the integer pipe against ~22 for the table lookup above, which is what
# bounds the table GEMV (Hopper's integer pipe runs at half the FP32 rate: docs/perf/2026-12-05-gpu-s14.md);
# the FMAs go to the FMA pipe, which the table GEMV leaves mostly idle.
LINEAR_CODE = tuple((q - 8) / 8 for q in range(16))  # must equal quant/gguf_4bit.code_table("q4")
# ANYGPU_LINEAR_4BIT=1 turns the arithmetic decoder on.  Off by default until it has run on a GPU: its PTX is
# checked by tests/test_decode_4bit_ptx.py and compiled for every NVIDIA target, but no GPU could be started after
# it was written (the GPU tests that decide it: test_matmul_4bit_offset.py, test_gguf_gpu_packed.py).
LINEAR_DECODE = os.environ.get("ANYGPU_LINEAR_4BIT", "0") == "1"
_LINEAR_SEEN: dict = {}  # id(table) -> (weak reference, version, answer)
_LINEAR_SEEN_MAX = 4096  # a model has a table per layer: hundreds


def linear_code(code: torch.Tensor) -> bool:
    """Whether the 16-entry table ``code`` is ``LINEAR_CODE`` (the launchers then take the arithmetic decoder).
    Compared once per table tensor (a device read) and remembered while that tensor lives unmodified; a table
    first seen during CUDA-graph capture, where no read is allowed, gets the table decoder, which is always right
    (the engine runs every layer eagerly before it captures)."""
    if not LINEAR_DECODE:
        return False
    hit = _LINEAR_SEEN.get(id(code))
    if hit is not None and hit[0]() is code and hit[1] == code._version:
        return hit[2]
    if code.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    answer = torch.equal(code.cpu(), torch.tensor(LINEAR_CODE, dtype=code.dtype))
    if len(_LINEAR_SEEN) >= _LINEAR_SEEN_MAX:
        for key in [k for k, v in _LINEAR_SEEN.items() if v[0]() is None]:
            del _LINEAR_SEEN[key]
        if len(_LINEAR_SEEN) >= _LINEAR_SEEN_MAX:
            _LINEAR_SEEN.clear()
    _LINEAR_SEEN[id(code)] = (weakref.ref(code), code._version, answer)
    return answer


# Per dtype: the magic (1024.0 fp16 / 128.0 bf16, whose lowest mantissa bit is worth 1), the FMA taking magic + q
# to (q - 8) / 8, and for fp16 the FMA taking magic + 16 q (the upper nibble of a byte left in place: fp16's
# mantissa has room for it, bf16's 7 bits do not, so bf16 shifts that nibble down first).
_LIN = {"f16": {"magic": "0x64006400", "mul": "0x30003000", "add": "0xD808D808",  # x 1/8 - 129
                "mul16": "0x20002000", "add16": "0xC880C880"},  # x 1/128 - 9
        "bf16": {"magic": "0x43004300", "mul": "0x3E003E00", "add": "0xC188C188"}}  # x 1/8 - 17


def _linear_pairs(t: str, src: str, outs: tuple) -> str:
    """``outs`` = the decoded 16-bit pairs of ``src``'s nibbles at bits 0 and 16 (low nibbles of its bytes 0 and
    2), 4 and 20, 8 and 24, 12 and 28 (fp16: only the first two; then src >> 8 gives the others)."""
    c = _LIN[t]
    lines = [f"mov.b32 mg, {c['magic']};", "mov.b32 nm, 0x000F000F;", f"mov.b32 ml, {c['mul']};",
             f"mov.b32 ad, {c['add']};"]
    if t == "f16":
        lines += ["mov.b32 nh, 0x00F000F0;", f"mov.b32 ml16, {c['mul16']};", f"mov.b32 ad16, {c['add16']};"]
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
DOT8_LINEAR_F16 = tl.constexpr(_DOT8_LINEAR.replace("{decode}", _linear_pairs("f16", "$5", ("p0", "p1", "p2", "p3")))
                               .replace("{t}", "f16").replace("{widen}", _WIDEN_F16))
DOT8_LINEAR_BF16 = tl.constexpr(_DOT8_LINEAR.replace("{decode}",
                                                     _linear_pairs("bf16", "$5", ("p0", "p1", "p2", "p3")))
                                .replace("{t}", "bf16").replace("{widen}", _WIDEN_BF16))

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
            + _linear_pairs(t, "s01", ("$2", "$0")) + _linear_pairs(t, "s23", ("$3", "$1"))
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
