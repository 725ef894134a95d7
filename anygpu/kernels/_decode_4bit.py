"""Decoding 4-bit weights inside kernels: block scales (with double quantization), table lookups, and
on NVIDIA a PTX decoder that turns 8 codes into 8 values with byte permutes on a table held in
registers.  Shared by the 4-bit matmul kernels (``matmul_4bit.py``).
"""

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
