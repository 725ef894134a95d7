"""Where a decode step's time goes on a GPU: random Llama-3-8B-shaped weights, torch.profiler over decode steps.

    python3 tools/profile_engine.py [--quantize nf4] [--batch 1] [--steps 20] [--tp 2] [--prefill]

Prints the split of a step run one at a time between scheduling, input preparation, the model call with sampling
and the scheduler's update (host clock), then profiles steps as the engine runs them (run-ahead included): the
GPU kernels by total time.  ``--prefill``: the warm prefill of ``--batch`` prompts of ``--input-len`` tokens
instead (what a request's TTFT is made of): host wall time against the GPU's kernel time and launch count, and
the kernels by total time (a lone prompt of up to 512 tokens replays its bucket's prefill graph, several prompts
run eagerly: ``engine/prefill_graphs.py``).
"""

from __future__ import annotations

import argparse
import time

import torch

from anygpu.bench.model import random_config, random_prompts
from anygpu.cli.bench_model import UNQUANTIZED
from anygpu.engine import LLMEngine, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantize", default=None, help="a quantization type (bf16 or none: the model's own dtype)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (rank 0 is profiled)")
    ap.add_argument("--prefill", action="store_true", help="profile warm prefill steps instead of decode steps")
    args = ap.parse_args()
    cfg = random_config("llama3-8b")
    quantize = None if args.quantize in UNQUANTIZED else args.quantize
    engine = LLMEngine("llama3-8b", config=cfg, quantize=quantize, max_num_seqs=args.batch,
                       max_model_len=args.input_len + 4 * args.steps + 64, progress=False, tp=args.tp)
    if args.prefill:
        profile_prefill(engine, cfg, args)
        engine.close()
        return
    params = SamplingParams(max_tokens=4 * args.steps, temperature=0, ignore_eos=True)
    for i, p in enumerate(random_prompts(args.batch, args.input_len, cfg.vocab_size)):
        engine.add_request(str(i), p, params)
    # The phase split below drives the scheduler and runner by hand, one step at a time: no step may be left
    # launched ahead (LLMEngine's run-ahead) when it starts.  The profiled steps at the end run as the engine does.
    run_ahead, engine.run_ahead = engine.run_ahead, False
    t = time.perf_counter()
    engine.step()  # prefill (all prompts fit the default budget)
    torch.cuda.synchronize()
    print(f"prefill step {1e3 * (time.perf_counter() - t):.1f} ms")
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    # Split a step into its phases (host clock, with a sync at the end of each).
    phases = {"schedule": 0.0, "pack": 0.0, "model+sample": 0.0, "update": 0.0}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = engine.scheduler.schedule()
        t1 = time.perf_counter()
        engine.runner.pack(batch)
        t2 = time.perf_counter()
        sampled = engine.runner.run(batch)
        t3 = time.perf_counter()
        engine.scheduler.update(batch, sampled)
        t4 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k] += v
    print("per step (ms): " + ", ".join(f"{k} {1e3 * v / args.steps:.3f}" for k, v in phases.items()))
    engine.run_ahead = run_ahead
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    print(f"profiled steps: {1e3 * (time.perf_counter() - t) / args.steps:.3f} ms/step (with profiler overhead)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    engine.close()


def profile_prefill(engine, cfg, args):
    """Warm prefills of ``args.batch`` prompts (one output token each, so a round is its prefill step and the
    request's end): host wall per round, then one round under the profiler."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = random_prompts(args.batch * (args.steps + 1), args.input_len, cfg.vocab_size)

    def one_round(r):
        for i in range(args.batch):
            engine.add_request(f"p{r}-{i}", prompts[r * args.batch + i], params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t)

    walls = sorted(one_round(r) for r in range(args.steps))
    print(f"prefill of {args.batch} x {args.input_len} tokens, {args.steps} warm rounds: wall min "
          f"{walls[0]:.2f} / median {walls[len(walls) // 2]:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = one_round(args.steps)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"profiled round: wall {wall:.2f} ms (with profiler overhead); GPU kernels "
          f"{sum(e.device_time for e in kernels) / 1e3:.2f} ms in {len(kernels)} launches")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
