"""Probe (session 33, not kept in the package): a Q4 (linear code) GEMM for 16-64 rows with the weight as wgmma's
register A operand, out^T = W x^T, against bf16 F.linear and the package's plan on Q4_K weights.

    python3 tools/probe_q4_register_a.py 64      # on a GPU: rows to try, comma-separated

Result and reading: docs/perf/2026-12-07-s33.md (0.41-0.69x F.linear where the package's GEMM makes 0.96-1.09x).

Each step: SUB blocks of 32 columns; a block's packed bytes [BN, 16] are decoded by two *unary* inline-asm calls
(high nibbles = even elements, low nibbles = odd ones) so Triton can hoist the dot-operand layout conversion up
to the byte load; scale and offset (one per row and block) are applied in registers; two dots of K = 16 with x's
even / odd columns (B operand, from shared memory).
"""
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import anygpu
from anygpu.bench.timing import measure_graph
from anygpu.ops import matmul_4bit
from anygpu.quant import gguf_4bit

# bf16: 128 + q from OR-ing the nibble under 128.0's exponent; (128 + q) / 8 - 17 = (q - 8) / 8 exactly.
_HI = """
    {
    .reg .b32 s01, s23, mg, nm, ml, ad;
    mov.b32 mg, 0x43004300; mov.b32 nm, 0x000F000F; mov.b32 ml, 0x3E003E00; mov.b32 ad, 0xC188C188;
    prmt.b32 s01, $2, 0, 0x4140;
    prmt.b32 s23, $2, 0, 0x4342;
    shr.u32 s01, s01, 4;
    shr.u32 s23, s23, 4;
    lop3.b32 $0, s01, nm, mg, 0xEA;
    lop3.b32 $1, s23, nm, mg, 0xEA;
    fma.rn.bf16x2 $0, $0, ml, ad;
    fma.rn.bf16x2 $1, $1, ml, ad;
    }
"""
_LO = tl.constexpr(_HI.replace("    shr.u32 s01, s01, 4;\n    shr.u32 s23, s23, 4;\n", ""))
_HI = tl.constexpr(_HI)


@triton.jit
def _hi(p):
    return tl.inline_asm_elementwise(_HI, "=r,=r,r", [p], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _lo(p):
    return tl.inline_asm_elementwise(_LO, "=r,=r,r", [p], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def q4_swap_kernel(x_ptr, w_ptr, s_ptr, o_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_om, stride_w,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr, SPLIT_K: tl.constexpr,
                   HAS_OFFSET: tl.constexpr, ASM: tl.constexpr = True,
                   BNB: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    blocks_per_row = K // 32
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    j = tl.arange(0, 16)
    w_rows = w_ptr + n64[:, None] * stride_w + j[None, :]
    # the weight is repacked at load so that byte j of a 32-block holds elements j (low) and j + 16 (high)
    x_lo = x_ptr + rm[None, :].to(tl.int64) * stride_xm + j[:, None]  # [16, BLOCK_M]
    # a multiple of the step, so that the compiler knows every step's loads are 16-byte aligned (cp.async)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), 32 * SUB) * (32 * SUB)
    k_begin = pid_k * k_per_split
    w_rows += k_begin // 2
    x_lo += k_begin
    blk0 = n64 * blocks_per_row + k_begin // 32
    for kb in range(0, tl.minimum(k_per_split, K - k_begin), 32 * SUB):
        for s in tl.static_range(SUB):
            k0 = kb + 32 * s
            packed = tl.load(w_rows + k0 // 2, mask=n_mask[:, None], other=0)
            blk = blk0 + k0 // 32
            sc = tl.load(s_ptr + blk, mask=n_mask, other=0.0)[:, None]
            if ASM:
                hi = _hi(packed) * sc
                lo = _lo(packed) * sc
            else:
                pi = packed.to(tl.int32)
                hi = ((((pi >> 4) & 15) - 8).to(tl.float32) * 0.125).to(tl.bfloat16) * sc
                lo = (((pi & 15) - 8).to(tl.float32) * 0.125).to(tl.bfloat16) * sc
            if HAS_OFFSET:
                off = tl.load(o_ptr + blk, mask=n_mask, other=0.0)[:, None]
                hi = hi + off
                lo = lo + off
            if BNB:  # x permuted: [even 16 | odd 16] per block; hi holds the even elements
                xh = tl.load(x_lo + k0, mask=m_mask[None, :], other=0.0)
                xl = tl.load(x_lo + k0 + 16, mask=m_mask[None, :], other=0.0)
            else:
                xl = tl.load(x_lo + k0, mask=m_mask[None, :], other=0.0)
                xh = tl.load(x_lo + k0 + 16, mask=m_mask[None, :], other=0.0)
            if ASM:
                acc = tl.dot(lo.to(tl.bfloat16), xl, acc)
                acc = tl.dot(hi.to(tl.bfloat16), xh, acc)
            else:  # the interpreter's check: fp32 dots of the bf16 values
                acc = tl.dot(lo.to(tl.bfloat16).to(tl.float32), xl.to(tl.float32), acc)
                acc = tl.dot(hi.to(tl.bfloat16).to(tl.float32), xh.to(tl.float32), acc)
    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.atomic_add(part_ptr + rm[:, None] * N + n[None, :], out, mask=m_mask[:, None] & n_mask[None, :],
                      sem="relaxed")


def permute_x(x):
    """[m, k] -> per 32-block [16 even | 16 odd] (the BNB form's x)."""
    m, k = x.shape
    return x.view(m, k // 32, 16, 2).transpose(-1, -2).contiguous().view(m, k)


def q4_swap(x, packed, scale, offset, n, k, cfg, part=None):
    if cfg.get("BNB"):
        x = permute_x(x)
    m = x.shape[0]
    BM = max(16, triton.next_power_of_2(m))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = cfg["SPLIT_K"]
    if split > 1:
        part.zero_()
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
    q4_swap_kernel[grid](x, packed, scale, offset if offset is not None else scale, out, part, m, n, k,
                         x.stride(0), out.stride(0), k // 2, BLOCK_N=cfg["BLOCK_N"], BLOCK_M=BM, SUB=cfg["SUB"],
                         SPLIT_K=split, HAS_OFFSET=offset is not None, num_warps=cfg["warps"],
                         num_stages=cfg["stages"], ASM=cfg.get("ASM", True), BNB=cfg.get("BNB", False))
    if split > 1:
        out.copy_(part[:m])
    return out


# --- the GPU sweep ---------------------------------------------------------------------------------------------


torch.manual_seed(0)
dev = torch.device("cuda")
print("package", anygpu.__file__, torch.cuda.get_device_name(), flush=True)
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
ROWS = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 32, 64]
CFGS = [dict(BLOCK_N=bn, warps=w, SUB=sub, SPLIT_K=sk, stages=st)
        for (bn, w), sub, sk, st in itertools.product(((64, 4), (128, 8)), (2, 4), (1, 2, 4), (3,))]
BNB_CFGS = [dict(BLOCK_N=bn, warps=w, SUB=sub, SPLIT_K=sk, stages=3, BNB=True)
            for (bn, w), sub, sk in itertools.product(((64, 4), (128, 8)), (2, 4), (1, 2))]
L2_PASS = 200 << 20


def repack(packed, n, k):
    p = packed.view(n, k // 2)
    codes = torch.empty(n, k, dtype=torch.uint8, device=p.device)
    codes[:, 0::2] = p >> 4
    codes[:, 1::2] = p & 15
    c = codes.view(n, k // 32, 2, 16)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


results = []
for n, k in SHAPES:
    w = (torch.randn(n, k, device=dev) * 0.02)
    pw = gguf_4bit.convert(gguf_4bit.quantize_q4_k(w), "Q4_K", n, k, half_scales=True)
    rp = repack(pw.packed, n, k)
    wb = w.to(torch.bfloat16)
    q_bytes = rp.numel() + pw.absmax.numel() * pw.absmax.element_size() * 2
    copies = max(2, L2_PASS // q_bytes + 1)
    qs = [(rp.clone(), pw.absmax.clone(), pw.offset.clone(), pw.packed.clone()) for _ in range(copies)]
    bcopies = max(2, L2_PASS // (wb.numel() * 2) + 1)
    bs = [wb.clone() for _ in range(bcopies)]
    part = torch.zeros(64, n, dtype=torch.float32, device=dev)
    for m in ROWS:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        ref = matmul_4bit(x, pw.packed, pw.absmax, pw.code, 32, n, k, offset=pw.offset)
        scale_ref = ref.float().abs().max().item()
        it = itertools.cycle(range(copies)); itb = itertools.cycle(range(bcopies))
        t_lin = measure_graph(lambda: F.linear(x, bs[next(itb)]), device=dev) * 1e3
        t_pkg = measure_graph(lambda: (lambda q: matmul_4bit(x, q[3], q[1], pw.code, 32, n, k, offset=q[2]))(
            qs[next(it)]), device=dev) * 1e3
        best = None
        bests = {}
        for cfg in CFGS + BNB_CFGS:
            try:
                wq = pw.packed if cfg.get("BNB") else rp
                y = q4_swap(x, wq, pw.absmax, pw.offset, n, k, cfg, part)
                err = (y.float() - ref.float()).abs().max().item() / scale_ref
                if err > 2e-2:
                    print(f"  BAD {n}x{k} m={m} {cfg} err {err:.3g}", flush=True)
                    continue
                t = measure_graph(lambda: (lambda q: q4_swap(x, q[3] if cfg.get("BNB") else q[0], q[1], q[2], n, k, cfg,
                                                             part))(qs[next(it)]), device=dev) * 1e3
            except Exception as e:
                print(f"  FAIL {cfg}: {type(e).__name__} {str(e)[:150]}", flush=True)
                continue
            results.append((n, k, m, cfg, t))
            tag = "bnb" if cfg.get("BNB") else "repacked"
            if tag not in bests or t < bests[tag][0]:
                bests[tag] = (t, cfg, err)
        print(f"{n}x{k} m={m}: F.linear {t_lin:.1f} us, package {t_pkg:.1f} ({t_lin / t_pkg:.2f}x)", flush=True)
        for tag, b in bests.items():
            print(f"    {tag}: {b[0]:.1f} us ({t_lin / b[0]:.2f}x) err {b[2]:.2g} {b[1]}", flush=True)
