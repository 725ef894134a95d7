"""Sweep (GPU): paged decode split counts and tile configs for few, long sequences; feeds SPLIT_BELOW / FILL and CONFIGS in kernels/paged_decode.py.

--short: few, short sequences instead (feeds SHORT_PARTITION / SHORT_SPLITS / SHORT_FROM): the plan against forced
split counts with max_seqlen = the context (a short max_model_len) and with max_seqlen 8192 (a decode graph's).
--combine: what combining the splits costs (feeds the combine in the kernel, `_merge_splits` / `last_arrival`):
the in-launch combine against the two-launch form (the capture fallback, forced) and against the splits' partials
alone (a bound: the capture fallback without its reduce launch, so no output).
"""
import sys
import time
import torch
from anygpu.bench.timing import measure_graph
from anygpu.bench.ceilings import copy_bandwidth
from anygpu.kernels import paged_decode as PD
from anygpu.kernels.launch import LaunchConfig

dev = torch.device("cuda")
bw = copy_bandwidth(dev)
print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True)
T0 = time.time()


def case(batch, ctx, qh=32, kvh=8, d=128, bs=16):
    per = -(-ctx // bs)
    nb = batch * per
    tables = torch.randperm(nb, device=dev).to(torch.int32).view(batch, per)
    kc = torch.randn(nb, bs, kvh, d, dtype=torch.bfloat16, device=dev)
    vc = torch.randn_like(kc)
    q = torch.randn(batch, qh, d, dtype=torch.bfloat16, device=dev)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    nbytes = 2 * batch * ctx * kvh * d * 2
    return q, kc, vc, tables, seqlens, nbytes


def t(fn):
    return measure_graph(fn, device=dev, warmup_ms=5, rep_ms=30)


class _NoLaunch:
    """Stands in for the fallback's reduce kernel: its launch does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


# How the launcher combines the splits, by what is patched into kernels/paged_decode.py while it runs: nothing
# (the in-launch combine); no counters (the capture fallback's two launches); no counters and no reduce launch
# (the splits' partials alone: a bound, the output is never written).
COMBINES = {"in-launch": {}, "two launches": {"counters": lambda device, tiles: None},
            "partials only": {"counters": lambda device, tiles: None, "_paged_decode_reduce_kernel": _NoLaunch()}}


if "--combine" in sys.argv:
    for batch, ctx, splits_list in [(1, 32768, (32, 64)), (2, 16384, (16, 32)), (8, 8192, (8,)), (1, 4096, (16,))]:
        q, kc, vc, tables, seqlens, nbytes = case(batch, ctx)
        res = []
        for s in splits_list:
            for name, patch in COMBINES.items():
                saved = {attr: getattr(PD, attr) for attr in patch}
                for attr, value in patch.items():
                    setattr(PD, attr, value)
                try:  # patched while the graph is captured: replays launch what was captured
                    ms = t(lambda: PD.paged_decode(q, kc, vc, tables, seqlens, ctx, num_splits=s))
                finally:
                    for attr, value in saved.items():
                        setattr(PD, attr, value)
                res.append(f"{s} {name}: {ms * 1e3:.1f}us/{100 * nbytes / (ms / 1e3) / bw:.0f}%")
        print(f"b{batch} ctx{ctx}: " + "  ".join(res), flush=True)
    sys.exit(0)

if "--short" in sys.argv:
    for batch in (1, 8):
        for ctx in (128, 192, 256, 384, 512, 1024, 2048):
            for maxlen in (ctx, 8192):
                q, kc, vc, tables, seqlens, nbytes = case(batch, maxlen)
                seqlens.fill_(ctx)
                res = [f"{s}:{t(lambda: PD.paged_decode(q, kc, vc, tables, seqlens, maxlen, num_splits=s)) * 1e3:.2f}us"
                       for s in (None, 1, 2, 4, 8, 16, 64)]
                print(f"b{batch} ctx{ctx} max_seqlen {maxlen}: " + "  ".join(res), flush=True)
    sys.exit(0)

orig = PD.CONFIGS
for tile, warps, stages in [(64, 4, 3), (32, 4, 3), (64, 4, 4), (64, 8, 3), (128, 8, 3), (32, 2, 4), (64, 4, 2)]:
    PD.CONFIGS = {**orig, "nvidia": PD._decode(PD._AOT_SHAPE, tile, num_warps=warps, num_stages=stages)}
    from anygpu.kernels import launch as C
    C._LAUNCH_CACHE.clear()
    for batch, ctx, splits_list in [(1, 32768, (None, 16, 32, 48, 64, 96, 128)), (8, 8192, (None, 4, 6, 8, 12, 16, 24)),
                                    (64, 4096, (None, 1, 2))]:
        q, kc, vc, tables, seqlens, nbytes = case(batch, ctx)
        res = []
        for s in splits_list:
            try:
                ms = t(lambda: PD.paged_decode(q, kc, vc, tables, seqlens, ctx, num_splits=s))
                res.append(f"{s}:{ms*1e3:.1f}us/{100*nbytes/(ms/1e3)/bw:.0f}%")
            except Exception as e:  # noqa
                res.append(f"{s}:ERR {repr(e)[:60]}")
        print(f"tile {tile} w{warps} s{stages} b{batch} ctx{ctx}: " + "  ".join(res) + f"  [{time.time()-T0:.0f}s]",
              flush=True)
