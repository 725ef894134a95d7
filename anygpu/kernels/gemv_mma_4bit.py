"""4-bit matmul for 1 to 8 rows of x on NVIDIA tensor cores, from bitsandbytes' own row-major layout.

Why: the CUDA-core GEMV spends most of its instructions on the products after decoding (16-bit pair
multiply-adds, widening, adding), one set per row of x, and the tiled GEMM moves every decoded tile through
shared memory into the MMA operand layout.  Here each lane decodes its codes straight into the registers of an
``mma.sync.m16n8k16`` A fragment (16 weight rows x 16 columns a warp) and the tensor core does the products for
up to 8 rows of x at once (x is the B fragment, 8 columns), in fp32: 8 rows cost what 1 costs.

No repacking: the columns of a 16-column MMA step may be any 16 columns, as long as A and B agree.  Lane
(g, q) (g = lane / 4, q = lane % 4) takes, over a step of 64 columns (4 MMAs), its rows' columns 16q .. 16q + 15:
8 bytes of weight row g and 8 of row g + 8 in bitsandbytes' layout, and x's row g over the same 16 columns.  MMA s
gives the lane's fragment slots k = 2q, 2q + 1, 2q + 8, 2q + 9 the columns 16q + 4s + 0, 1, 2, 3, so its A
registers are the nibbles of bytes 2s and 2s + 1 of each row's 8 (one byte permute makes the word the decoder
takes) and its B registers are two pairs of x.  The 64 columns of a step lie in one 4-bit block (the block size
is a multiple of 64), so each row's scale multiplies the step's sums once.

Grid: (N / (16 * warps), SPLITS): each warp 16 output features over 1/SPLITS of K.  NVIDIA only (inline PTX);
Triton's interpreter runs the same steps with the table lookup and a broadcast product in place of the MMA.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._decode_4bit import ELEMENT_ORDER, _block_scales, _decode_setup, _lookup, _lookup_half, _tables
from ._split_k import add_partials, last_arrival


def _mma_steps(bf16: bool) -> str:
    """One 64-column step of a lane: $0..$3 the fp32 C fragment (rows g, g + 8 x columns 2q, 2q + 1);
    $4, $5: row g's 8 bytes (low, high word); $6, $7: row g + 8's; $8..$15: x's 16 values as pairs; $16..$23:
    the tables."""
    t = "bf16" if bf16 else "f16"
    body = ["""
        {
        .reg .b32 b, sl, sh, ml, mh, a0, a1, ll, hh, w, f0, f1, f2, f3;
        mov.f32 $0, 0f00000000;
        mov.f32 $1, 0f00000000;
        mov.f32 $2, 0f00000000;
        mov.f32 $3, 0f00000000;"""]
    for s in range(4):
        g, g8 = ("$4", "$6") if s < 2 else ("$5", "$7")
        # bytes 2s and 2s + 1 of each row (within its word) -> (row g, row g + 8, row g, row g + 8)
        body.append(f"\n        prmt.b32 w, {g}, {g8}, {'0x5140' if s % 2 == 0 else '0x7362'};")
        body.append(_decode_setup("w"))
        body.append(_lookup_half(16, "sl", "ml", ELEMENT_ORDER, ("f0", "f1")))
        body.append(_lookup_half(16, "sh", "mh", ELEMENT_ORDER, ("f2", "f3")))
        body.append(f"""
        mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{$0, $1, $2, $3}}, {{f0, f1, f2, f3}},
            {{${8 + 2 * s}, ${9 + 2 * s}}}, {{$0, $1, $2, $3}};""")
    return "".join(body) + "\n        }\n"


MMA_F16 = tl.constexpr(_mma_steps(False))
MMA_BF16 = tl.constexpr(_mma_steps(True))
MMA_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 20))


@triton.jit
def _mma_step(r0lo, r0hi, r1lo, r1hi, x0, x1, x2, x3, x4, x5, x6, x7, t0, t1, t2, t3, u0, u1, u2, u3,
              BF16: tl.constexpr):
    args = [r0lo, r0hi, r1lo, r1hi, x0, x1, x2, x3, x4, x5, x6, x7, t0, t1, t2, t3, u0, u1, u2, u3]
    if BF16:
        return tl.inline_asm_elementwise(MMA_BF16, MMA_CONSTRAINTS, args, dtype=(tl.float32,) * 4, is_pure=True,
                                         pack=1)
    return tl.inline_asm_elementwise(MMA_F16, MMA_CONSTRAINTS, args, dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _gemv_mma_4bit_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
                          nested_code_ptr, nested_absmax_ptr, nested_offset_ptr,
                          M, N, K, stride_xm, stride_om, stride_w, SPLITS,
                          BLOCKSIZE: tl.constexpr, WARPS: tl.constexpr, PARTIAL: tl.constexpr, REDUCE: tl.constexpr,
                          NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, DECODE_PTX: tl.constexpr):
    tl.static_assert(BLOCKSIZE % 64 == 0)
    lane = tl.arange(0, 32 * WARPS)  # one element per thread: element i is lane i % 32 of warp i // 32
    g = (lane % 32) // 4
    q = lane % 4
    r0 = (tl.program_id(0) * WARPS + lane // 32) * 16 + g
    r1 = r0 + 8
    steps = K // 64
    per_split = tl.cdiv(steps, SPLITS)
    s_begin = tl.program_id(1) * per_split
    s_end = tl.minimum(s_begin + per_split, steps)
    blocks_per_row = K // BLOCKSIZE
    # rows past N and x's rows past M read as zeros (n < where(...): a scalar & a vector trips the interpreter)
    m0 = r0 < N
    m1 = r1 < N
    mx = g < M
    c0 = tl.zeros((32 * WARPS,), dtype=tl.float32)
    c1 = tl.zeros((32 * WARPS,), dtype=tl.float32)
    c2 = tl.zeros((32 * WARPS,), dtype=tl.float32)
    c3 = tl.zeros((32 * WARPS,), dtype=tl.float32)
    if DECODE_PTX:
        t0, t1, t2, t3, u0, u1, u2, u3 = _tables(code_ptr, x_ptr.dtype.element_ty == tl.bfloat16)
        words = w_ptr.to(tl.pointer_type(tl.int32))
        p0 = words + r0.to(tl.int64) * stride_w + 2 * q  # the lane's 8 bytes of a step: words 2q, 2q + 1
        p1 = words + r1.to(tl.int64) * stride_w + 2 * q
        px = x_ptr.to(tl.pointer_type(tl.int32)) + g.to(tl.int64) * (stride_xm // 2) + 8 * q
        # Two steps an iteration, every load of both issued before either MMA: a lane's loads are small (8 bytes
        # of each row), so keeping more of them in flight is what feeds the memory system.
        for s in range(s_begin, s_end, 2):
            more = s + 1 < s_end  # the second step exists (else its loads are masked off and add zeros)
            n0 = r0 < tl.where(more, N, 0)
            n1 = r1 < tl.where(more, N, 0)
            a0, a1, a2, a3, y0, y1, y2, y3, y4, y5, y6, y7 = _step_loads(p0, p1, px, s, m0, m1, mx)
            b0, b1, b2, b3, z0, z1, z2, z3, z4, z5, z6, z7 = _step_loads(p0, p1, px, s + 1, n0, n1,
                                                                         g < tl.where(more, M, 0))
            s0, s1 = _step_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, r0, r1, m0, m1,
                                  s * 64 // BLOCKSIZE, blocks_per_row, NESTED)
            e0, e1 = _step_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, r0, r1, n0, n1,
                                  (s + 1) * 64 // BLOCKSIZE, blocks_per_row, NESTED)
            d0, d1, d2, d3 = _mma_step(a0, a1, a2, a3, y0, y1, y2, y3, y4, y5, y6, y7, t0, t1, t2, t3, u0, u1, u2, u3,
                                       x_ptr.dtype.element_ty == tl.bfloat16)
            f0, f1, f2, f3 = _mma_step(b0, b1, b2, b3, z0, z1, z2, z3, z4, z5, z6, z7, t0, t1, t2, t3, u0, u1, u2, u3,
                                       x_ptr.dtype.element_ty == tl.bfloat16)
            c0 += d0 * s0 + f0 * e0
            c1 += d1 * s0 + f1 * e0
            c2 += d2 * s1 + f2 * e1
            c3 += d3 * s1 + f3 * e1
    else:
        # The same sums without the MMA: rows r0 / r1 of W against x's rows 2q and 2q + 1, 16 columns at a time.
        lut = tl.load(code_ptr + tl.arange(0, 16))
        for s in range(s_begin, s_end):
            s0, s1 = _step_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, r0, r1, m0, m1,
                                  s * 64 // BLOCKSIZE, blocks_per_row, NESTED)
            for j in tl.static_range(4):
                col = s * 64 + 16 * j
                v0 = _decoded(w_ptr, r0, m0, K, col, lut)
                v1 = _decoded(w_ptr, r1, m1, K, col, lut)
                xa = _x_cols(x_ptr, 2 * q, M, stride_xm, col)
                xb = _x_cols(x_ptr, 2 * q + 1, M, stride_xm, col)
                c0 += tl.sum(v0 * xa, axis=1) * s0
                c1 += tl.sum(v0 * xb, axis=1) * s0
                c2 += tl.sum(v1 * xa, axis=1) * s1
                c3 += tl.sum(v1 * xb, axis=1) * s1
    # The C fragment: lane (g, q) holds rows r0, r1 of the output's columns (rows of x) 2q and 2q + 1.
    # PARTIAL: this split's slice of the [SPLITS, M, N] fp32 partials, all four before the program counts in on its
    # tile (the program's 16 * WARPS features); REDUCE: the tile's last split adds them (kernels/_split_k.py).
    dst = part_ptr + tl.program_id(1).to(tl.int64) * M * N if PARTIAL else out_ptr
    _store(dst, bias_ptr, c0, 2 * q, r0, M, N, stride_om, PARTIAL, HAS_BIAS)
    _store(dst, bias_ptr, c1, 2 * q + 1, r0, M, N, stride_om, PARTIAL, HAS_BIAS)
    _store(dst, bias_ptr, c2, 2 * q, r1, M, N, stride_om, PARTIAL, HAS_BIAS)
    _store(dst, bias_ptr, c3, 2 * q + 1, r1, M, N, stride_om, PARTIAL, HAS_BIAS)
    if PARTIAL and REDUCE:
        last = last_arrival(counter_ptr, tl.program_id(0), SPLITS)
        if last:
            _add(part_ptr, out_ptr, bias_ptr, 2 * q, r0, M, N, stride_om, SPLITS, HAS_BIAS)
            _add(part_ptr, out_ptr, bias_ptr, 2 * q + 1, r0, M, N, stride_om, SPLITS, HAS_BIAS)
            _add(part_ptr, out_ptr, bias_ptr, 2 * q, r1, M, N, stride_om, SPLITS, HAS_BIAS)
            _add(part_ptr, out_ptr, bias_ptr, 2 * q + 1, r1, M, N, stride_om, SPLITS, HAS_BIAS)


# Vector loads of a lane's operands, predicated (a lane past the weight's rows or x's rows loads zeros): Triton
# gives one element a thread 4-byte loads, and x's 8 words a step were what the load unit spent its time on.
LD2 = tl.constexpr("""
        {
        .reg .pred p;
        setp.ne.b32 p, $3, 0;
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        @p ld.global.v2.b32 {$0, $1}, [$2];
        }
""")
LD4 = tl.constexpr("""
        {
        .reg .pred p;
        setp.ne.b32 p, $5, 0;
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        mov.b32 $2, 0;
        mov.b32 $3, 0;
        @p ld.global.v4.b32 {$0, $1, $2, $3}, [$4];
        }
""")


@triton.jit
def _step_loads(p0, p1, px, s, m0, m1, mx):
    """A lane's operands of step s: rows g and g + 8's 8 bytes each (two words a row), x's 8 words of pairs."""
    w0 = s * 8  # a step is 64 columns: 8 words of codes a row, 32 words of x pairs
    xs = px + s * 32
    a0, a1 = tl.inline_asm_elementwise(LD2, "=r,=r,l,r", [p0 + w0, m0.to(tl.int32)], dtype=(tl.int32, tl.int32),
                                       is_pure=True, pack=1)
    a2, a3 = tl.inline_asm_elementwise(LD2, "=r,=r,l,r", [p1 + w0, m1.to(tl.int32)], dtype=(tl.int32, tl.int32),
                                       is_pure=True, pack=1)
    y0, y1, y2, y3 = tl.inline_asm_elementwise(LD4, "=r,=r,=r,=r,l,r", [xs, mx.to(tl.int32)],
                                               dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    y4, y5, y6, y7 = tl.inline_asm_elementwise(LD4, "=r,=r,=r,=r,l,r", [xs + 4, mx.to(tl.int32)],
                                               dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    return a0, a1, a2, a3, y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def _step_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, r0, r1, m0, m1, block,
                 blocks_per_row, NESTED: tl.constexpr):
    s0 = _block_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr,
                       r0.to(tl.int64) * blocks_per_row + block, m0, NESTED)
    s1 = _block_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr,
                       r1.to(tl.int64) * blocks_per_row + block, m1, NESTED)
    return s0, s1


@triton.jit
def _x_cols(x_ptr, row, M, stride_xm, col):
    """Row ``row`` (one per element) of x at columns col .. col + 15, fp32 [elements, 16] (rows past M: zeros)."""
    k = tl.arange(0, 16)
    x = tl.load(x_ptr + row.to(tl.int64)[:, None] * stride_xm + col + k[None, :], mask=(row < M)[:, None], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _decoded(w_ptr, row, ok, K, col, lut):
    """Row ``row`` (one per element) of W at columns col .. col + 15, decoded (unscaled), fp32 [elements, 16]."""
    packed = tl.load(w_ptr + row.to(tl.int64)[:, None] * (K // 2) + col // 2 + tl.arange(0, 8)[None, :],
                     mask=ok[:, None], other=0).to(tl.int32)
    return tl.interleave(_lookup(lut, packed >> 4), _lookup(lut, packed & 15))  # the high nibble: even columns


@triton.jit
def _store(out_ptr, bias_ptr, acc, col, row, M, N, stride_om, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc (one per element) to out[col, row] where col < M and row < N; PARTIAL: out_ptr is this split's
    [M, N] fp32 slice of the partials (the bias is added with them)."""
    mask = (row < N) & (col < M)
    if PARTIAL:
        tl.store(out_ptr + col.to(tl.int64) * N + row, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + row, mask=row < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + col.to(tl.int64) * stride_om + row, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add(part_ptr, out_ptr, bias_ptr, col, row, M, N, stride_om, SPLITS, HAS_BIAS: tl.constexpr):
    """out[col, row] (col < M, row < N) = the partials' slices at [col, row] added in order, + bias[row]."""
    add_partials(part_ptr + col.to(tl.int64) * N + row, M * N, SPLITS, bias_ptr, row,
                 out_ptr + col.to(tl.int64) * stride_om + row, (row < N) & (col < M), HAS_BIAS)
