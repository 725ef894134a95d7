"""Where the 8-bit AdamW step's time goes on this GPU (a tuning aid): the shipped kernel's work, piece by piece,
on 1B fp32 parameters, each level adding one part of the step to the one before (same memory traffic at every
level: p and g in fp32, both states' codes and block absmax):
  0 stream only (p += g; codes copied), 1 + dequantize (code-map gathers), 2 + the update arithmetic,
  3 + block absmax and the scaled magnitudes, 4 + the bucket search, 5 + non-finite gradients handled (the
  shipped kernel's work).
Against torch's fused AdamW and the shipped ``update_8bit``.  ``profile``: three shipped steps on 64M elements
and nothing else, for Nsight Compute, e.g. ``ncu --kernel-name regex:_optim_8bit_kernel --launch-skip 1
--launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy python3
tools/probe_optim_8bit.py profile`` (docs/benchmarks-h200.md has what it showed).  States are Adam-like
(the reference's codes of m = 0.4 g and v = 0.005 g^2 for the constant g), as the bench's.  ``gathers``: the
shipped step with its table gathers as tl.load and as inline PTX (PTX_GATHER), timed, compared, and their
shared-memory instructions counted.
Usage: python3 tools/probe_optim_8bit.py [profile | gathers]"""

import torch
import triton
import triton.language as tl

from anygpu.bench.timing import measure
from anygpu.kernels import optim_8bit as O

dev = torch.device("cuda")


@triton.jit
def _arithmetic_codes(s, q_ptr, absmax_ptr, first, base, rows, local, in_range, left):
    absmax = tl.max(tl.abs(s), axis=1)
    tl.store(absmax_ptr + first + rows, absmax, mask=rows * 256 < left)
    q, neg = O._scaled_magnitude(s, absmax)
    tl.store(q_ptr + base + local, ((q * 127.0).to(tl.int32) ^ neg).to(tl.uint8), mask=in_range)


@triton.jit
def _ablation_kernel(p_ptr, g_ptr, s1_ptr, s2_ptr, absmax1_ptr, absmax2_ptr, code1_ptr, code2_ptr, lut1_ptr, lut2_ptr,
                     n, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, decay,
                     LEVEL: tl.constexpr, BLOCKS: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCKS
    base = first * 256
    rows = tl.arange(0, BLOCKS)
    local = rows[:, None] * 256 + tl.arange(0, 256)[None, :]
    left = tl.minimum(n - base, BLOCKS * 256).to(tl.int32)
    in_range = local < left
    g = tl.load(g_ptr + base + local, mask=in_range, other=0.0)
    p = tl.load(p_ptr + base + local, mask=in_range, other=0.0)
    if LEVEL >= 5:
        finite = tl.abs(g) < float("inf")
        g = tl.where(finite, g, 0.0)
    if LEVEL == 0:
        c1 = tl.load(s1_ptr + base + local, mask=in_range, other=0)
        c2 = tl.load(s2_ptr + base + local, mask=in_range, other=0)
        a1 = tl.load(absmax1_ptr + first + rows, mask=rows * 256 < left, other=0.0)
        a2 = tl.load(absmax2_ptr + first + rows, mask=rows * 256 < left, other=0.0)
        tl.store(p_ptr + base + local, p + g * step_size, mask=in_range)
        tl.store(s1_ptr + base + local, c1 + 1, mask=in_range)
        tl.store(s2_ptr + base + local, c2 + 1, mask=in_range)
        tl.store(absmax1_ptr + first + rows, a1 * 0.5, mask=rows * 256 < left)
        tl.store(absmax2_ptr + first + rows, a2 * 0.5, mask=rows * 256 < left)
    else:
        s1 = O._dequantize(s1_ptr, absmax1_ptr, code1_ptr, lut1_ptr, first, base, rows, local, in_range, left, True)
        s2 = O._dequantize(s2_ptr, absmax2_ptr, code2_ptr, lut2_ptr, first, base, rows, local, in_range, left, True)
        if LEVEL == 1:
            new_p = p + (s1 + s2) * step_size
        else:
            new_p, s1, s2, _ = O._update(p, g, s1, s2, s1, beta1, beta2, one_minus_beta1, one_minus_beta2, eps,
                                         step_size, 0.0, decay, 0, 0.0, 0.0, 0.0, 1.0, 1.0, 0, True)
            if LEVEL >= 5:
                new_p = tl.where(finite, new_p, p)
                s1 = tl.where(finite, s1, 0.0)
                s2 = tl.where(finite, s2, 0.0)
        tl.store(p_ptr + base + local, new_p, mask=in_range)
        if LEVEL <= 2:  # codes from the values' bits, absmax from one lane: no reduction, no search
            a1 = tl.load(absmax1_ptr + first + rows, mask=rows * 256 < left, other=0.0)
            a2 = tl.load(absmax2_ptr + first + rows, mask=rows * 256 < left, other=0.0)
            tl.store(s1_ptr + base + local, (s1.to(tl.int32, bitcast=True) >> 23).to(tl.uint8), mask=in_range)
            tl.store(s2_ptr + base + local, (s2.to(tl.int32, bitcast=True) >> 23).to(tl.uint8), mask=in_range)
            tl.store(absmax1_ptr + first + rows, a1 * 0.5, mask=rows * 256 < left)
            tl.store(absmax2_ptr + first + rows, a2 * 0.5, mask=rows * 256 < left)
        elif LEVEL == 3:  # absmax and the scaled magnitudes; codes from them by arithmetic
            _arithmetic_codes(s1, s1_ptr, absmax1_ptr, first, base, rows, local, in_range, left)
            _arithmetic_codes(s2, s2_ptr, absmax2_ptr, first, base, rows, local, in_range, left)
        else:
            O._requantize(s1, lut1_ptr, code1_ptr, s1_ptr, absmax1_ptr, first, base, rows, local, in_range, left,
                          True, True)
            O._requantize(s2, lut2_ptr, code2_ptr, s2_ptr, absmax2_ptr, first, base, rows, local, in_range, left,
                          False, True)


def _codes(s, qmap, signed):
    """s's blockwise 8-bit state (256-element blocks): the reference's codes and each block's absmax."""
    blocks = s.view(-1, 256)
    absmax = blocks.abs().amax(1)
    codes = O.reference_codes((blocks / absmax[:, None]).reshape(-1), qmap, signed)
    return codes.to(torch.uint8), absmax.contiguous()


def main(n=8 * 8192 * 16384, profile=False):
    from anygpu.optim import reference
    from anygpu.optim.optimizer import search_tables
    from anygpu.quant.maps import dynamic_map

    p = torch.randn(n, device=dev) * 0.02
    g = torch.randn(n, device=dev) * 1e-3
    q1, q2 = dynamic_map(dev, True), dynamic_map(dev, False)
    # Adam-like states, as the bench's after a few steps of its constant gradient: m = 0.4 g, v = 0.005 g^2
    (s1, a1), (s2, a2) = (_codes(0.4 * g, q1, True), _codes(0.005 * g * g, q2, False))
    lut1, lut2 = search_tables(q1, q2)
    k = reference.step_scalars("adam", 1e-3, 0.9, 0.999, 1e-8, 0.01, 10)
    if profile:
        for _ in range(3):
            O.update_8bit("adam", p, g, s1, s2, a1, a2, q1, q2, k, lut1, lut2)
        torch.cuda.synchronize()
        return

    def t(fn):
        return measure(fn, device=dev, warmup_ms=25, rep_ms=100) * 1e3

    shipped = t(lambda: O.update_8bit("adam", p, g, s1, s2, a1, a2, q1, q2, k, lut1, lut2))
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(p.view(8, -1)[i].clone()) for i in range(8)], fused=True)
    for q in torch_opt.param_groups[0]["params"]:
        q.grad = torch.randn_like(q) * 1e-3
    base = t(torch_opt.step)
    del torch_opt
    print(f"torch AdamW fused {base:.0f} us; shipped 8-bit {shipped:.0f} us ({base / shipped:.2f}x); "
          f"16 bytes an element: {16 * n / shipped / 1e6:.2f} TB/s", flush=True)
    for level in range(6):
        for blocks_, warps in ((1, 1), (4, 4)):
            grid = (triton.cdiv(n, 256 * blocks_),)
            us = t(lambda: _ablation_kernel[grid](p, g, s1, s2, a1, a2, q1, q2, lut1, lut2, n, k.beta1, k.beta2,
                                                  k.one_minus_beta1, k.one_minus_beta2, k.eps, k.step_size,
                                                  k.decay, LEVEL=level, BLOCKS=blocks_, num_warps=warps))
            print(f"  level {level} ({blocks_} block(s), {warps} warp(s)): {us:.0f} us, "
                  f"{16 * n / us / 1e6:.2f} TB/s", flush=True)


def gathers(n=8 * 8192 * 16384):
    """The shipped step with its table gathers as tl.load or as inline PTX (PTX_GATHER): time, shared-memory
    instructions in the PTX this Triton makes, and bit-exactness between the two."""
    from anygpu.kernels.config import LaunchConfig
    from anygpu.optim import reference
    from anygpu.optim.optimizer import search_tables
    from anygpu.quant.maps import dynamic_map

    torch.manual_seed(0)
    g = torch.randn(n, device=dev) * 1e-3
    p0 = torch.randn(n, device=dev) * 0.02
    q1, q2 = dynamic_map(dev, True), dynamic_map(dev, False)
    (s10, a10), (s20, a20) = (_codes(0.4 * g, q1, True), _codes(0.005 * g * g, q2, False))
    lut1, lut2 = search_tables(q1, q2)
    k = reference.step_scalars("adam", 1e-3, 0.9, 0.999, 1e-8, 0.01, 10)
    results = []
    for ptx_gather, blocks_, warps in ((False, 1, 1), (True, 1, 1), (True, 2, 2)):
        cfg = LaunchConfig({"BLOCKS": blocks_, "PTX_GATHER": ptx_gather}, num_warps=warps)
        state = [x.clone() for x in (p0, s10, s20, a10, a20)]
        O.update_8bit("adam", state[0], g, state[1], state[2], state[3], state[4], q1, q2, k, lut1, lut2, config=cfg)
        results.append(state)
        same = all(torch.equal(x, y) for x, y in zip(results[0], state))
        if not same:  # how far: parameters against their update, codes and absmax that moved
            ref_p = results[0][0]
            moved = [int((x != y).sum()) for x, y in zip(results[0][1:], state[1:])]
            off = ((state[0] - ref_p).abs() / (ref_p - p0).abs().clamp_min(1e-30)).max()
            absmax_off = ((state[4] - results[0][4]).abs() / results[0][4].abs().clamp_min(1e-30)).max()
            same = (f"no: p differs at {int((state[0] != ref_p).sum())} of {n} (at most {float(off):.2e} of "
                    f"its update); "
                    f"codes1, codes2, absmax1, absmax2 differ at {moved} (absmax2 by {float(absmax_off):.2e} at most)")
        p, s1, s2, a1, a2 = [x.clone() for x in state]  # timing steps these on; the results stay
        us = measure(lambda: O.update_8bit("adam", p, g, s1, s2, a1, a2, q1, q2, k, lut1, lut2, config=cfg),
                     device=dev, warmup_ms=25, rep_ms=100) * 1e3
        ptx = list(O._optim_8bit_kernel.device_caches[0][0].values())[-1].asm["ptx"]
        print(f"PTX_GATHER={ptx_gather} BLOCKS={blocks_} warps={warps}: {us:.0f} us ({16 * n / us / 1e6:.2f} TB/s), "
              f"same as tl.load's: {same}; ld.shared {ptx.count('ld.shared')} st.shared {ptx.count('st.shared')}",
              flush=True)


if __name__ == "__main__":
    import sys

    if "gathers" in sys.argv:
        gathers()
    elif "profile" in sys.argv:
        main(64 * 1024 * 1024, profile=True)
    else:
        main()
