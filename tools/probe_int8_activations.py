"""Probe (issue 22/23, session 20): the 16-64-row GGUF GEMMs with x quantized to int8 per block of 32 and int8
tensor-core dots, one per weight block, rescaled into fp32 (llama.cpp's MMQ approach).  Not a package path:
kept in git history only (docs/perf/2026-12-06-s20.md).  Four parts, as written in lab/ and run as separate files:
w8a8.py (Q8_0), w4a8.py (Q4_K), w8a8_bench.py and w4a8_bench.py (GPU sweeps against F.linear and the package's
plan; `python3 w8a8_bench.py 64`)."""

# ======== w8a8.py ========
PART_W8A8 = r'''
"""Probe: Q8_0 GEMM at 16-128 rows with x quantized to int8 per 32-block (llama.cpp's MMQ approach) and int8
tensor-core dots, one dot per weight block, each rescaled by x's and W's block scales into an fp32 accumulator."""
import itertools, os, sys
import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _quant_x(x_ptr, q_ptr, s_ptr, K, KB, BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    i = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = b[:, None] < KB
    v = tl.load(x_ptr + row * K + i, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    t = v * inv[:, None]
    q = tl.where(t >= 0, t + 0.5, t - 0.5).to(tl.int8)
    tl.store(q_ptr + row * K + i, q, mask=mask)
    tl.store(s_ptr + row * KB + b, amax / 127.0, mask=b < KB)


@triton.jit
def _gemm_w8a8(xq_ptr, xs_ptr, wq_ptr, ws_ptr, out_ptr, M, N, K, KB, blocks_per_split,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, MODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    sid = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 32)
    mm = rm < M
    nm = rn < N
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_lo = sid * blocks_per_split
    for kb in range(b_lo, b_lo + blocks_per_split, G):
        for g in tl.static_range(G):
            k0 = (kb + g) * 32
            a = tl.load(xq_ptr + rm[:, None] * K + k0 + rk[None, :], mask=mm[:, None], other=0)
            b = tl.load(wq_ptr + rn64[None, :] * K + k0 + rk[:, None], mask=nm[None, :], other=0)
            d = tl.dot(a, b, out_dtype=tl.int32)
            sx = tl.load(xs_ptr + rm * KB + kb + g, mask=mm, other=0.0)
            sw = tl.load(ws_ptr + rn64 * KB + kb + g, mask=nm, other=0.0).to(tl.float32)
            if MODE == 0:
                acc += d.to(tl.float32) * (sx[:, None] * sw[None, :])
            else:  # |d| < 2^22: int32 -> fp32 by a magic number (the int-to-float unit is quarter rate)
                f = (d + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
                acc += f * (sx[:, None] * sw[None, :])
    off = sid.to(tl.int64) * M * N
    tl.store(out_ptr + off + rm[:, None] * N + rn[None, :], acc, mask=mm[:, None] & nm[None, :])


def quant_x(x):
    m, k = x.shape
    kb = k // 32
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    BLOCKS = 16
    _quant_x[(m, triton.cdiv(kb, BLOCKS))](x, q, s, k, kb, BLOCKS=BLOCKS, num_warps=2)
    return q, s


def w8a8(x, wq, ws, cfg, parts=None):
    m, k = x.shape
    n = wq.shape[0]
    kb = k // 32
    bm, bn, g, split, warps, stages = cfg[:6]
    mode = cfg[6] if len(cfg) > 6 else 1
    assert kb % (g * split) == 0, (kb, g, split)
    q, s = quant_x(x)
    if parts is None:
        parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _gemm_w8a8[grid](q, s, wq, ws, parts, m, n, k, kb, kb // split, BLOCK_M=bm, BLOCK_N=bn, G=g, MODE=mode,
                     num_warps=warps, num_stages=stages)
    return (parts[0] if split == 1 else parts.sum(0)).to(x.dtype)


def q8_0(w):
    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    amax = b.abs().amax(-1)
    d = (amax / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(amax))
    q = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return q.contiguous(), d.reshape(n, kb := k // 32).contiguous()


def check(dev):
    torch.manual_seed(0)
    for (m, n, k, cfg) in [(5, 96, 256, (16, 32, 2, 2, 4, 2)), (64, 128, 512, (64, 64, 4, 1, 4, 3)),
                           (70, 64, 128, (64, 64, 2, 2, 4, 2))]:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
        w = torch.randn(n, k, device=dev) * 0.02
        wq, ws = q8_0(w)
        ref = x.float() @ (wq.float() * ws.float().repeat_interleave(32, 1)).T
        got = w8a8(x, wq, ws, cfg).float()
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        print(f"check m={m} n={n} k={k}: max err / max |ref| = {err:.2e}", flush=True)
        assert err < 2e-2, err


if __name__ == "__main__":
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check(dev)
'''

# ======== w4a8.py ========
PART_W4A8 = r'''
"""Probe: Q4_K (anygpu's per-32 fp16 scale + offset form) at 16-128 rows with x in int8 per 32-block: nibbles to
int8 in registers, int8 tensor-core dot per block, rescale + offset * sum(x) into fp32."""
import sys
import torch
import triton
import triton.language as tl


@triton.jit
def _quant_xs(x_ptr, q_ptr, s_ptr, sum_ptr, K, KB, BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    i = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = b[:, None] < KB
    v = tl.load(x_ptr + row * K + i, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    t = v * inv[:, None]
    q = tl.where(t >= 0, t + 0.5, t - 0.5).to(tl.int8)
    tl.store(q_ptr + row * K + i, q, mask=mask)
    tl.store(s_ptr + row * KB + b, amax / 127.0, mask=b < KB)
    tl.store(sum_ptr + row * KB + b, tl.sum(v, axis=1), mask=b < KB)


@triton.jit
def _gemm_w4a8(xq_ptr, xs_ptr, xsum_ptr, wp_ptr, ws_ptr, wo_ptr, out_ptr, M, N, K, KB, blocks_per_split,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    sid = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 32)
    rh = tl.arange(0, 16)
    mm = rm < M
    nm = rn < N
    rn64 = rn.to(tl.int64)
    half_k = K // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_lo = sid * blocks_per_split
    for kb in range(b_lo, b_lo + blocks_per_split, G):
        for g in tl.static_range(G):
            k0 = (kb + g) * 32
            a = tl.load(xq_ptr + rm[:, None] * K + k0 + rk[None, :], mask=mm[:, None], other=0)
            p = tl.load(wp_ptr + rn64[:, None] * half_k + k0 // 2 + rh[None, :], mask=nm[:, None], other=0)
            hi = (p >> 4).to(tl.int8) - 8
            lo = (p & 15).to(tl.int8) - 8
            w = tl.reshape(tl.join(hi, lo), (BLOCK_N, 32))
            d = tl.dot(a, tl.trans(w), out_dtype=tl.int32)
            f = (d + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
            sx = tl.load(xs_ptr + rm * KB + kb + g, mask=mm, other=0.0)
            xsum = tl.load(xsum_ptr + rm * KB + kb + g, mask=mm, other=0.0)
            sw = tl.load(ws_ptr + rn64 * KB + kb + g, mask=nm, other=0.0).to(tl.float32) * 0.125
            ow = tl.load(wo_ptr + rn64 * KB + kb + g, mask=nm, other=0.0).to(tl.float32)
            acc += f * (sx[:, None] * sw[None, :]) + xsum[:, None] * ow[None, :]
    off = sid.to(tl.int64) * M * N
    tl.store(out_ptr + off + rm[:, None] * N + rn[None, :], acc, mask=mm[:, None] & nm[None, :])


def quant_xs(x):
    m, k = x.shape
    kb = k // 32
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    xsum = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    _quant_xs[(m, triton.cdiv(kb, 16))](x, q, s, xsum, k, kb, BLOCKS=16, num_warps=2)
    return q, s, xsum


def w4a8(x, packed, absmax, offset, cfg):
    m, k = x.shape
    kb = k // 32
    n = packed.numel() * 2 // k
    bm, bn, g, split, warps, stages = cfg[:6]
    assert kb % (g * split) == 0, (kb, g, split)
    q, s, xsum = quant_xs(x)
    parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _gemm_w4a8[grid](q, s, xsum, packed, absmax, offset, parts, m, n, k, kb, kb // split, BLOCK_M=bm, BLOCK_N=bn,
                     G=g, num_warps=warps, num_stages=stages)
    return (parts[0] if split == 1 else parts.sum(0)).to(x.dtype)


def dequant(packed, absmax, offset, n, k):
    p = packed.view(n, k // 2).to(torch.int32)
    codes = torch.stack([p >> 4, p & 15], -1).reshape(n, k // 32, 32).float()
    return (((codes - 8) / 8) * absmax.float().view(n, -1, 1) + offset.float().view(n, -1, 1)).reshape(n, k)


def check(dev):
    from anygpu.quant import gguf_4bit
    torch.manual_seed(0)
    for (m, n, k, cfg) in [(5, 96, 512, (16, 32, 2, 2, 4, 2)), (64, 128, 512, (64, 64, 4, 1, 4, 3))]:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
        w = torch.randn(n, k, device=dev) * 0.02
        qq = gguf_4bit.convert(gguf_4bit.quantize_q4_k(w).reshape(-1), "Q4_K", n, k, half_scales=True)
        ref = x.float() @ dequant(qq.packed, qq.absmax, qq.offset, n, k).T
        got = w4a8(x, qq.packed, qq.absmax, qq.offset, cfg).float()
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        print(f"check w4a8 m={m} n={n} k={k}: max err / max |ref| = {err:.2e}", flush=True)
        assert err < 2e-2, err


if __name__ == "__main__":
    check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
'''

# ======== w8a8_bench.py ========
PART_W8A8_BENCH = r'''
import itertools, sys, time
import torch
import torch.nn.functional as F
sys.path.insert(0, "lab")
from w8a8 import w8a8, quant_x, check
from anygpu.bench.timing import measure_graph
from anygpu.kernels import matmul_int8_block as K8
from anygpu.quant import gguf_8bit

DEV = torch.device("cuda")
SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]


def us(fn):
    return measure_graph(fn, device=DEV, warmup_ms=10, rep_ms=40) * 1e3


def make(n, k):
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) * 0.02
    p = gguf_8bit.convert(gguf_8bit.quantize_q8_0(w).reshape(-1), "Q8_0", n, k, half_scales=True)
    return w, p


def cands(m):
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    for bn, g, warps, stages, split in itertools.product((64, 128, 256), (1, 2), (4, 8), (3,), (1,)):
        if (bn == 64 and warps == 8) or (bn == 256 and warps == 4) or (bn == 256 and g == 4):
            continue
        yield (bm, bn, g, split, warps, stages)


def run(n, k, m, cfgs, top=6):
    nw = max(2, -(-200_000_000 // (n * k)))
    weights = [make(n, k) for _ in range(nw)]
    dense = [w for w, _ in weights]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    turn = {"i": 0}

    def nxt(seq):
        turn["i"] += 1
        return seq[turn["i"] % len(seq)]
    base = us(lambda: F.linear(x, nxt(dense)))
    plan = K8.plan(m, n, k, 32, torch.bfloat16, DEV)
    p0 = weights[0][1]
    pkg = us(lambda: K8.matmul_int8_block(x, (pw := nxt(weights)[1]).codes, pw.scale, 32, plan_=plan))
    ref = (x.float() @ (p0.codes.float() * p0.scale.float().repeat_interleave(32).reshape(n, k)).T)
    e_pkg = ((K8.matmul_int8_block(x, p0.codes, p0.scale, 32, plan_=plan).float() - ref).abs().max() / ref.abs().max()).item()
    e_lin = ((F.linear(x, weights[0][0]).float() - x.float() @ weights[0][0].float().T).abs().max() / ref.abs().max()).item()
    qx = us(lambda: quant_x(x))
    res = []
    for cfg in cfgs:
        try:
            w8a8(x, p0.codes, p0.scale.view(n, k // 32), cfg)
            t = us(lambda: w8a8(x, (pw := nxt(weights)[1]).codes, pw.scale.view(n, k // 32), cfg))
            res.append((t, cfg))
        except Exception as e:  # noqa
            print("   failed", cfg, str(e)[:100], flush=True)
    res.sort(key=lambda r: r[0])
    best = res[0][1]
    e_new = ((w8a8(x, p0.codes, p0.scale.view(n, k // 32), best).float() - ref).abs().max() / ref.abs().max()).item()
    print(f"M={m} {n}x{k}: F.linear {base:.1f} us | package {plan.path} {pkg:.1f} ({base / pkg:.2f}x) | "
          f"quant_x {qx:.1f} | err/max: pkg {e_pkg:.1e} new {e_new:.1e} F.linear(bf16 w) {e_lin:.1e}", flush=True)
    for t, cfg in res[:top]:
        print(f"   {t:7.1f} us {base / t:5.2f}x  bm,bn,g,split,warps,stages={cfg}", flush=True)
    return [c for _, c in res]


if __name__ == "__main__":
    torch.manual_seed(0)
    check(DEV)
    rows = [int(a) for a in sys.argv[1:]] or [64, 16, 32, 128]
    for m in rows:
        t0 = time.time()
        ranked = run(*SHAPES[0], m, list(cands(m)))
        run(*SHAPES[0], m, [c[:6] + (0,) for c in ranked[:3]], top=3)  # the int-to-float unit instead
        for n, k in SHAPES[1:]:
            run(n, k, m, [c for c in ranked[:4] if (k // 32) % (c[2] * c[3]) == 0] +
                [(c[0], c[1], c[2], s, c[4], c[5]) for c in ranked[:3] for s in (2, 4) if (k // 32) % (c[2] * s) == 0 and s != c[3]], top=4)
        print(f"rows {m}: {time.time() - t0:.0f} s", flush=True)
'''

# ======== w4a8_bench.py ========
PART_W4A8_BENCH = r'''
import itertools, sys, time
import torch
import torch.nn.functional as F
sys.path.insert(0, "lab")
from w4a8 import w4a8, quant_xs, check, dequant
from anygpu.bench.timing import measure_graph
from anygpu.kernels import matmul_4bit as K4
from anygpu.quant import gguf_4bit

DEV = torch.device("cuda")
SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]


def us(fn):
    return measure_graph(fn, device=DEV, warmup_ms=10, rep_ms=40) * 1e3


def make(n, k):
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) * 0.02
    return w, gguf_4bit.convert(gguf_4bit.quantize_q4_k(w).reshape(-1), "Q4_K", n, k, half_scales=True)


def cands(m):
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    for bn, g, warps, split in itertools.product((64, 128, 256), (1, 2), (4, 8), (1,)):
        if (bn == 64 and warps == 8) or (bn == 256 and warps == 4) or (bn == 256 and g == 4):
            continue
        yield (bm, bn, g, split, warps, 3)


def run(n, k, m, cfgs, top=6):
    weights = [make(n, k) for _ in range(max(2, -(-200_000_000 // (n * k // 2))))]
    dense = [w for w, _ in weights[:max(2, -(-200_000_000 // (n * k * 2)))]]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    turn = {"i": 0}

    def nxt(seq):
        turn["i"] += 1
        return seq[turn["i"] % len(seq)]
    base = us(lambda: F.linear(x, nxt(dense)))
    plan = K4.plan(m, n, k, 32, torch.bfloat16, DEV)
    q0 = weights[0][1]
    pk = lambda q: K4.matmul_4bit(x, q.packed, q.absmax, q.code, gguf_4bit.BLOCKSIZE, n, k, None, offset=q.offset, plan_=plan)
    pkg = us(lambda: pk(nxt(weights)[1]))
    ref = x.float() @ dequant(q0.packed, q0.absmax, q0.offset, n, k).T
    e_pkg = ((pk(q0).float() - ref).abs().max() / ref.abs().max()).item()
    res = []
    for cfg in cfgs:
        try:
            w4a8(x, q0.packed, q0.absmax, q0.offset, cfg)
            res.append((us(lambda: w4a8(x, (q := nxt(weights)[1]).packed, q.absmax, q.offset, cfg)), cfg))
        except Exception as e:  # noqa
            print("   failed", cfg, str(e)[:100], flush=True)
    res.sort(key=lambda r: r[0])
    e_new = ((w4a8(x, q0.packed, q0.absmax, q0.offset, res[0][1]).float() - ref).abs().max() / ref.abs().max()).item()
    print(f"Q4_K M={m} {n}x{k}: F.linear {base:.1f} us | package {plan.path} {pkg:.1f} ({base / pkg:.2f}x) | "
          f"quant_x {us(lambda: quant_xs(x)):.1f} | err/max: pkg {e_pkg:.1e} new {e_new:.1e}", flush=True)
    for t, cfg in res[:top]:
        print(f"   {t:7.1f} us {base / t:5.2f}x  bm,bn,g,split,warps,stages={cfg}", flush=True)
    return [c for _, c in res]


if __name__ == "__main__":
    torch.manual_seed(0)
    check(DEV)
    for m in [int(a) for a in sys.argv[1:]] or [64]:
        t0 = time.time()
        ranked = run(*SHAPES[0], m, list(cands(m)))
        for n, k in SHAPES[1:]:
            run(n, k, m, [c for c in ranked[:4] if (k // 32) % (c[2] * c[3]) == 0] +
                [(c[0], c[1], c[2], s, c[4], c[5]) for c in ranked[:3] for s in (2, 4) if (k // 32) % (c[2] * s) == 0 and s != c[3]], top=4)
        print(f"rows {m}: {time.time() - t0:.0f} s", flush=True)
'''


if __name__ == "__main__":
    import pathlib
    import sys
    dest = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "lab")
    dest.mkdir(exist_ok=True)
    for name, text in (("w8a8.py", PART_W8A8), ("w4a8.py", PART_W4A8), ("w8a8_bench.py", PART_W8A8_BENCH),
                       ("w4a8_bench.py", PART_W4A8_BENCH)):
        (dest / name).write_text(text)
    print("written to", dest)
