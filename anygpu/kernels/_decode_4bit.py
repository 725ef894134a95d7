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
def _lookup(code_ptr, lut, idx, LUT_GATHER: tl.constexpr):
    """code[idx]: from a copy of the 16-entry table held by the program (tl.gather), or from global memory
    (all 16 entries share one cache line, so a warp's lookups are one L1 transaction)."""
    if LUT_GATHER:
        return tl.gather(lut, idx.reshape(idx.numel), 0).reshape(idx.shape)
    return tl.load(code_ptr + idx)


@triton.jit
def _tables(code_ptr):
    """The 16 fp16 code values as 8 registers of bytes: TL[i] holds the low bytes of codes 4i..4i+3."""
    r = tl.arange(0, 16)
    v = tl.load(code_ptr + r).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo = (v & 0xFF) << ((r % 4) * 8)
    hi = (v >> 8) << ((r % 4) * 8)
    g = r // 4
    return (tl.sum(tl.where(g == 0, lo, 0)), tl.sum(tl.where(g == 1, lo, 0)), tl.sum(tl.where(g == 2, lo, 0)),
            tl.sum(tl.where(g == 3, lo, 0)), tl.sum(tl.where(g == 0, hi, 0)), tl.sum(tl.where(g == 1, hi, 0)),
            tl.sum(tl.where(g == 2, hi, 0)), tl.sum(tl.where(g == 3, hi, 0)))

@triton.jit
def _decode8(w, t0, t1, t2, t3, u0, u1, u2, u3):
    """NVIDIA only: the 8 codes of each int32 word to fp32 values, from the table in registers, with no
    memory access: ``prmt`` picks bytes of the low and high halves of the table by the codes' low 3
    bits, a ``lop3`` chooses between the halves by bit 3 (turned into byte masks by prmt's sign mode),
    two more ``prmt`` interleave low and high bytes into fp16 pairs.  ~3 instructions per element,
    where a lookup in memory costs 4-5.  Outputs are in nibble order: elements 1, 0, 3, 2, 5, 4, 7, 6."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 b, sl, sh, ml, mh, a0, a1, ll, hh, o0, o1;
        .reg .b16 h0, h1, h2, h3;
        shl.b32 b, $8, 4;
        and.b32 sl, $8, 0x7777;
        shr.u32 sh, $8, 16;
        and.b32 sh, sh, 0x7777;
        prmt.b32 ml, b, $8, 0xD9C8;
        prmt.b32 mh, b, $8, 0xFBEA;
        prmt.b32 a0, $9, $10, sl;
        prmt.b32 a1, $11, $12, sl;
        lop3.b32 ll, a0, a1, ml, 0xD8;
        prmt.b32 a0, $13, $14, sl;
        prmt.b32 a1, $15, $16, sl;
        lop3.b32 hh, a0, a1, ml, 0xD8;
        prmt.b32 o0, ll, hh, 0x5140;
        prmt.b32 o1, ll, hh, 0x7362;
        mov.b32 {h0, h1}, o0;
        mov.b32 {h2, h3}, o1;
        cvt.f32.f16 $0, h0;
        cvt.f32.f16 $1, h1;
        cvt.f32.f16 $2, h2;
        cvt.f32.f16 $3, h3;
        prmt.b32 a0, $9, $10, sh;
        prmt.b32 a1, $11, $12, sh;
        lop3.b32 ll, a0, a1, mh, 0xD8;
        prmt.b32 a0, $13, $14, sh;
        prmt.b32 a1, $15, $16, sh;
        lop3.b32 hh, a0, a1, mh, 0xD8;
        prmt.b32 o0, ll, hh, 0x5140;
        prmt.b32 o1, ll, hh, 0x7362;
        mov.b32 {h0, h1}, o0;
        mov.b32 {h2, h3}, o1;
        cvt.f32.f16 $4, h0;
        cvt.f32.f16 $5, h1;
        cvt.f32.f16 $6, h2;
        cvt.f32.f16 $7, h3;
        }
        """,
        "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r,r",
        [w, t0, t1, t2, t3, u0, u1, u2, u3],
        dtype=(tl.float32,) * 8, is_pure=True, pack=1)
