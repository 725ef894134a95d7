"""Where a CPU decode step of the default model goes: the int4 matmuls, their Python side, the other ops.

    python3 tools/profile_cpu_decode.py [--steps 60] [--repeats 3]

One sequence (a random 32-token prompt, greedy, EOS ignored) on one torch thread, the engine's own default model
(SmolLM2 Q4_1 kept packed).  After 11 warm-up decode steps, ``--steps`` steps are timed.  The parts are timed by
wrapping from outside (nothing is timed inside the library): the model's op symbols in ``anygpu.models.llama``,
``GGUFLinear.forward`` (the whole packed projection) and ``aten._weight_int4pack_mm_for_cpu`` (the kernel alone),
so "int4 Python side" is the projection less its kernel.  Each row is the mean per step of one run; the runs
are printed side by side (the machine may be shared: compare runs, not single numbers).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch


def _timed(fn, acc, key):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start
    return wrapper


def run(steps: int) -> dict[str, float]:
    import anygpu.models.llama as llama
    from anygpu.bench import model as bm
    from anygpu.engine import LLMEngine, SamplingParams
    from anygpu.nn.linear_gguf import GGUFLinear

    acc: collections.Counter = collections.Counter()
    saved = [(llama, name, getattr(llama, name)) for name in
             ("paged_decode", "rotary_and_cache", "fused_add_rms_norm", "rms_norm", "silu_and_mul")]
    saved += [(GGUFLinear, "forward", GGUFLinear.forward),
              (torch.ops.aten, "_weight_int4pack_mm_for_cpu", torch.ops.aten._weight_int4pack_mm_for_cpu)]
    engine = LLMEngine(None, max_num_seqs=1, progress=False)
    try:
        for owner, name, fn in saved:
            setattr(owner, name, _timed(fn, acc, name))
        bm.warm_up(engine, 32, engine.config.vocab_size)
        prompt = bm.random_prompts(1, 32, engine.config.vocab_size)[0]
        engine.add_request("p", prompt, SamplingParams(max_tokens=steps + 13, temperature=0.0, ignore_eos=True))
        for _ in range(12):  # the prefill and 11 decode steps
            engine.step()
        acc.clear()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        engine.close()
    kernel, projection = acc.pop("_weight_int4pack_mm_for_cpu"), acc.pop("forward")
    parts = {"step": total, "int4 kernel": kernel, "int4 Python side": projection - kernel}
    parts.update(acc)
    parts["rest (embedding, logits' Python side, sampling, engine)"] = total - projection - sum(acc.values())
    return {k: v / steps * 1e3 for k, v in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [run(args.steps) for _ in range(args.repeats)]
    print(f"ms per decode step, {args.repeats} runs; capability {torch.backends.cpu.get_cpu_capability()}")
    for key in runs[0]:
        print(f"| {key} | " + " | ".join(f"{r[key]:.1f}" for r in runs) + " |")


if __name__ == "__main__":
    main()
