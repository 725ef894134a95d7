"""Probe (GPU): paged decode's split combine as a second, wide launch (one program per (row, dim chunk), all the
splits' loads in flight at once), with and without PDL, against the shipped in-launch combine."""
import sys
import torch
import triton
import triton.language as tl
from anygpu.bench.timing import measure_graph
from anygpu.bench.ceilings import copy_bandwidth
from anygpu.kernels import paged_decode as PD
from anygpu.kernels._pdl import wait_then_release, pdl_args

dev = torch.device("cuda")
bw = copy_bandwidth(dev)
print(f"{torch.cuda.get_device_name()} copy bandwidth {bw/1e12:.2f} TB/s", flush=True)


@triton.jit
def wide_reduce(part_out_ptr, part_lse_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr, SP: tl.constexpr,
                DCH: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    d = tl.program_id(1) * DCH + tl.arange(0, DCH)
    smask = s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=smask, other=float("-inf"))
    part = tl.load(part_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None],
                   other=0.0)
    m = tl.max(lse, 0)
    m_base = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_base)
    total = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * part, 0)
    o = tl.div_rn(acc, tl.where(total == 0.0, 1.0, total))
    tl.store(out_ptr + row * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def seq_reduce(part_out_ptr, part_lse_ptr, out_ptr, num_splits, numel, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
               UNROLL: tl.constexpr, PDL: tl.constexpr):
    """The shipped sequential combine (online softmax over the splits in order), BLOCK elements a program."""
    wait_then_release(PDL)
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < numel
    row = e // HEAD_DIM
    lse_at = part_lse_ptr + row * num_splits
    part_at = part_out_ptr + row * num_splits * HEAD_DIM + e % HEAD_DIM
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    s = 0
    while s < num_splits:
        for u in tl.static_range(UNROLL):
            live = mask & (tl.full([BLOCK], s + u, tl.int32) < num_splits)
            lse = tl.load(lse_at + (s + u), mask=live, other=float("-inf"))
            part = tl.load(part_at + (s + u) * HEAD_DIM, mask=live, other=0.0)
            m_new = tl.maximum(m, lse)
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_base)
            w = tl.exp2(lse - m_base)
            total = total * alpha + w
            acc = acc * alpha + w * part
            m = m_new
        s += UNROLL
    o = tl.div_rn(acc, tl.where(total == 0.0, 1.0, total))
    tl.store(out_ptr + e, o.to(out_ptr.dtype.element_ty), mask=mask)


class Seq:
    def __init__(self, block, unroll, warps):
        self.block, self.unroll, self.warps = block, unroll, warps

    def __getitem__(self, grid):
        def launch(part_out, part_lse, out, num_splits, numel, HEAD_DIM, **kw):
            seq_reduce[(triton.cdiv(numel, self.block),)](part_out, part_lse, out, num_splits, numel,
                                                          HEAD_DIM=HEAD_DIM, BLOCK=self.block, UNROLL=self.unroll,
                                                          num_warps=self.warps, **pdl_args(out.device))
        return launch


class Wide:
    def __init__(self, pdl, dch, warps):
        self.pdl, self.dch, self.warps = pdl, dch, warps

    def __getitem__(self, grid):
        def launch(part_out, part_lse, out, num_splits, numel, HEAD_DIM, **kw):
            rows = numel // HEAD_DIM
            extra = pdl_args(out.device) if self.pdl else {"PDL": False}
            wide_reduce[(rows, HEAD_DIM // self.dch)](part_out, part_lse, out, num_splits, HEAD_DIM=HEAD_DIM,
                                                    SP=triton.next_power_of_2(num_splits), DCH=self.dch,
                                                    num_warps=self.warps, **extra)
        return launch


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


NOCOUNT = {"counters": lambda device, tiles: None}
VARIANTS = {"in-launch": {}, "partials": {**NOCOUNT, "_paged_decode_reduce_kernel": _NoLaunch()},
            "2L shipped": NOCOUNT,
            "2L wide64 w4": {**NOCOUNT, "_paged_decode_reduce_kernel": Wide(False, 64, 4)},
            "2L wide64 w4 PDL": {**NOCOUNT, "_paged_decode_reduce_kernel": Wide(True, 64, 4)},
            "2L wide32 w2 PDL": {**NOCOUNT, "_paged_decode_reduce_kernel": Wide(True, 32, 2)},
            "2L seq128 u8 PDL": {**NOCOUNT, "_paged_decode_reduce_kernel": Seq(128, 8, 1)},
            "2L seq128 u32 PDL": {**NOCOUNT, "_paged_decode_reduce_kernel": Seq(128, 32, 1)},
            "2L wide128 w4 PDL": {**NOCOUNT, "_paged_decode_reduce_kernel": Wide(True, 128, 4)}}


def case(batch, ctx, qh=32, kvh=8, d=128, bs=16):
    per = -(-ctx // bs)
    nb = batch * per
    tables = torch.randperm(nb, device=dev).to(torch.int32).view(batch, per)
    kc = torch.randn(nb, bs, kvh, d, dtype=torch.bfloat16, device=dev)
    vc = torch.randn_like(kc)
    q = torch.randn(batch, qh, d, dtype=torch.bfloat16, device=dev)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return q, kc, vc, tables, seqlens, 2 * batch * ctx * kvh * d * 2


def patched(patch, fn):
    saved = {a: getattr(PD, a) for a in patch}
    for a, v in patch.items():
        setattr(PD, a, v)
    try:
        return fn()
    finally:
        for a, v in saved.items():
            setattr(PD, a, v)


CASES = [(1, 32768, 32768, (32, 64)), (1, 16384, 16384, (32, 64)), (8, 8192, 8192, (8,)),
         (1, 4096, 4096, (16,)), (1, 2048, 8192, (16,))]
for batch, ctx, maxlen, splits in CASES:
    q, kc, vc, tables, seqlens, nbytes = case(batch, maxlen)
    seqlens.fill_(ctx)
    nbytes = nbytes * ctx // maxlen
    ref = PD.paged_decode(q, kc, vc, tables, seqlens, maxlen, num_splits=1).float()
    for s in splits:
        row = []
        for name, patch in VARIANTS.items():
            if name != "partials":
                out = patched(patch, lambda: PD.paged_decode(q, kc, vc, tables, seqlens, maxlen, num_splits=s))
                err = (out.float() - ref).abs().max().item()
            else:
                err = 0.0
            ms = patched(patch, lambda: measure_graph(
                lambda: PD.paged_decode(q, kc, vc, tables, seqlens, maxlen, num_splits=s), device=dev, warmup_ms=5,
                rep_ms=25))
            row.append(f"{name} {ms * 1e3:.1f}us/{100 * nbytes / (ms / 1e3) / bw:.0f}%" + (
                f" e{err:.0e}" if err > 2e-2 else ""))
        print(f"b{batch} ctx{ctx} max{maxlen} s{s}: " + " | ".join(row), flush=True)
