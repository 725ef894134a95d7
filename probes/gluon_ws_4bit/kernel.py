"""Probe: a Gluon (Hopper) 4-bit GEMM for 17-64 rows: weight tile decoded in registers (the package's PTX
pair decoder), stored to shared memory, wgmma issued async so the next step's decode overlaps this step's MMA."""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

import importlib.util, os
_spec = importlib.util.spec_from_file_location("_d4", os.path.join(os.path.dirname(__file__), "..", "..", "anygpu", "kernels",
                                                                    "_decode_4bit.py"))
_d4 = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(_d4)
DECODE_PAIRS = _d4.DECODE_PAIRS

_bar = getattr(gl, "barrier", None) or gl.thread_barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
PAIRS = gl.constexpr(DECODE_PAIRS.value if hasattr(DECODE_PAIRS, "value") else DECODE_PAIRS)
PAIRS_C = gl.constexpr("=r,=r,=r,=r,r" + ",r" * 32)


@gluon.jit
def _tables(code_ptr, BF16: gl.constexpr, num_warps: gl.constexpr):
    l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    r = gl.arange(0, 16, layout=l)
    if BF16:
        v = gl.load(code_ptr + r).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    else:
        v = gl.load(code_ptr + r).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    lo = (v & 0xFF) << ((r % 4) * 8)
    hi = (v >> 8) << ((r % 4) * 8)
    g = r // 4
    return (gl.sum(gl.where(g == 0, lo, 0), axis=0), gl.sum(gl.where(g == 1, lo, 0), axis=0),
            gl.sum(gl.where(g == 2, lo, 0), axis=0), gl.sum(gl.where(g == 3, lo, 0), axis=0),
            gl.sum(gl.where(g == 0, hi, 0), axis=0), gl.sum(gl.where(g == 1, hi, 0), axis=0),
            gl.sum(gl.where(g == 2, hi, 0), axis=0), gl.sum(gl.where(g == 3, hi, 0), axis=0))


@gluon.jit
def _scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, idx, mask, NESTED: gl.constexpr):
    if NESTED:
        q = gl.load(absmax_ptr + idx, mask=mask, other=0).to(gl.int32)
        s = gl.load(nested_code_ptr + q) * gl.load(nested_absmax_ptr + idx // 256, mask=mask, other=0.0)
        s += gl.load(nested_offset_ptr)
    else:
        s = gl.load(absmax_ptr + idx, mask=mask, other=0.0).to(gl.float32)
    return s


@gluon.jit
def _mma_partition(x_s, w_s, ready, empty, part_ptr, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr):
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    acc = gl.full([BLOCK_M, BLOCK_N], 0.0, gl.float32, mma_l)
    k_per_split = gl.cdiv(gl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = gl.program_id(1) * k_per_split
    steps = gl.cdiv(gl.minimum(k_begin + k_per_split, K) - k_begin, BLOCK_K)
    for i in range(steps):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc = warpgroup_mma(x_s.index(s), w_s.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)  # step i - 1's MMA is done
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    pid_n = gl.program_id(0)
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_l))
    cn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_l))
    out = part_ptr + gl.program_id(1).to(gl.int64) * M * N + rm.to(gl.int64)[:, None] * N + cn[None, :]
    gl.store(out, acc, mask=(rm < M)[:, None] & (cn < N)[None, :])


@gluon.jit
def _decode_partition(x_s, w_s, ready, empty, x_ptr, w_ptr, absmax_ptr, code_ptr, nested_code_ptr, nested_absmax_ptr,
                      nested_offset_ptr, M, N, K, stride_xm, stride_w, BLOCKSIZE: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NESTED: gl.constexpr,
                      BF16: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr, DW: gl.constexpr):
    SUB: gl.constexpr = BLOCK_K // BLOCKSIZE
    HB: gl.constexpr = BLOCKSIZE // 2
    TPB: gl.constexpr = HB // 16
    codes_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [32 // (SUB * TPB), SUB, TPB], [DW, 1, 1], [2, 1, 0])
    sc_l: gl.constexpr = gl.SliceLayout(2, codes_l)
    XT: gl.constexpr = BLOCK_K // 8
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // XT, XT], [DW, 1], [1, 0])

    pid_n = gl.program_id(0)
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sc_l))
    sb = gl.arange(0, SUB, layout=gl.SliceLayout(0, sc_l))
    s3 = gl.arange(0, SUB, layout=gl.SliceLayout(1, gl.SliceLayout(0, codes_l)))
    j = gl.arange(0, HB, layout=gl.SliceLayout(0, gl.SliceLayout(0, codes_l)))
    n_mask = n < N
    n64 = gl.where(n_mask, n, 0).to(gl.int64)
    w_tile = w_ptr + n64[:, None, None] * stride_w + (s3[:, None] * HB + j[None, :])[None, :, :]
    blk = n64[:, None] * (K // BLOCKSIZE) + sb[None, :]
    xr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_l))
    xc = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_l))
    x_tile = x_ptr + gl.where(xr < M, xr, 0).to(gl.int64)[:, None] * stride_xm + xc[None, :]

    t0, t1, t2, t3, u0, u1, u2, u3 = _tables(code_ptr, BF16, DW)
    k_per_split = gl.cdiv(gl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = gl.program_id(1) * k_per_split
    steps = gl.cdiv(gl.minimum(k_begin + k_per_split, K) - k_begin, BLOCK_K)
    packed = gl.load(w_tile + k_begin // 2)
    sc = _scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, blk + k_begin // BLOCKSIZE,
                 n_mask[:, None], NESTED)
    xv = gl.load(x_tile + k_begin)
    for i in range(steps):
        s = i % STAGES
        kn = gl.minimum(k_begin + (i + 1) * BLOCK_K, K - BLOCK_K)  # the next step (past the end: in range, unused)
        nxt = gl.load(w_tile + kn // 2)
        sc_nxt = _scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, blk + kn // BLOCKSIZE,
                         n_mask[:, None], NESTED)
        xv_nxt = gl.load(x_tile + kn)
        if BF16:
            hi, lo = gl.inline_asm_elementwise(PAIRS, PAIRS_C, [packed, t0, t1, t2, t3, u0, u1, u2, u3],
                                               dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        else:
            hi, lo = gl.inline_asm_elementwise(PAIRS, PAIRS_C, [packed, t0, t1, t2, t3, u0, u1, u2, u3],
                                               dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        scd = sc.to(hi.dtype)[:, :, None]
        w = gl.reshape(gl.join(hi * scd, lo * scd), [BLOCK_N, BLOCK_K])
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        w_s.index(s).store(w)
        x_s.index(s).store(xv)
        fence_async_shared()
        mbarrier.arrive(ready.index(s), count=1)
        packed = nxt
        sc = sc_nxt
        xv = xv_nxt


@gluon.jit
def ws_4bit_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, part_ptr, nested_code_ptr, nested_absmax_ptr,
                   nested_offset_ptr, M, N, K, stride_xm, stride_w,
                   BLOCKSIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   NESTED: gl.constexpr, BF16: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
                   DW: gl.constexpr, DREGS: gl.constexpr, num_warps: gl.constexpr):
    dt: gl.constexpr = gl.bfloat16 if BF16 else gl.float16
    smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_M, BLOCK_K], smem_l)
    w_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, BLOCK_K], smem_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma_partition, (x_s, w_s, ready, empty, part_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, STAGES)),
        (_decode_partition, (x_s, w_s, ready, empty, x_ptr, w_ptr, absmax_ptr, code_ptr, nested_code_ptr,
                             nested_absmax_ptr, nested_offset_ptr, M, N, K, stride_xm, stride_w, BLOCKSIZE, BLOCK_M,
                             BLOCK_N, BLOCK_K, NESTED, BF16, SPLIT_K, STAGES, DW)),
    ], [DW], [DREGS])


def signature(dtype="bf16"):
    return {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "absmax_ptr": "*u8", "code_ptr": "*fp32", "part_ptr": "*fp32",
            "nested_code_ptr": "*fp32", "nested_absmax_ptr": "*fp32", "nested_offset_ptr": "*fp32",
            "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_w": "i32"}


CONSTS = ("BLOCKSIZE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NESTED", "BF16", "SPLIT_K", "STAGES", "DW", "DREGS",
          "num_warps")


def compile_for(consts, cap=90, dtype="bf16", maxnreg=None):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = signature(dtype)
    for k in CONSTS:
        sig[k] = "constexpr"
    c = dict(consts, num_warps=4)
    attrs = {(list(sig).index(k),): [["tt.divisibility", 16]]
             for k in ("x_ptr", "w_ptr", "part_ptr", "K", "stride_xm", "stride_w", "N")}
    src = GluonASTSource(fn=ws_4bit_kernel, signature=sig, constexprs={(list(sig).index(k),): v for k, v in c.items()},
                         attrs=attrs)
    opts = {"num_warps": 4}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options=opts)


if __name__ == "__main__":
    import os, re, subprocess, tempfile
    for bn, bk, st, dw, dregs, maxn in ((128, 64, 4, 4, 128, 128), (128, 64, 4, 8, 96, 128), (256, 64, 3, 8, 96, 168),
                                         (64, 128, 4, 4, 128, 128)):
        k = compile_for({"BLOCKSIZE": 64, "BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": bk, "NESTED": True, "BF16": True,
                         "SPLIT_K": 4, "STAGES": st, "DW": dw, "DREGS": dregs}, maxnreg=maxn)
        f = tempfile.mktemp(suffix=".cubin"); open(f, "wb").write(k.asm["cubin"])
        cu = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        t = subprocess.run([cu, "-res-usage", f], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", t)
        print(triton.__version__, bn, bk, st, dw, dregs, maxn, m.groups() if m else t[:300], "smem", k.metadata.shared,
              flush=True)
