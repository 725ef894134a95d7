"""Where a CPU decode step of the default model goes: the int4 matmuls, their Python side, the other ops.

    python3 tools/profile_cpu_decode.py [--steps 60] [--repeats 3] [--floor]

One sequence (a random 32-token prompt, greedy, EOS ignored) on one torch thread, the engine's own default model
(SmolLM2 Q4_1 kept packed).  After 11 warm-up decode steps, ``--steps`` steps are timed.  The parts are timed by
wrapping from outside (nothing is timed inside the library): the model's op symbols in ``anygpu.models.llama``,
``GGUFLinear.forward`` (the whole packed projection) and ``aten._weight_int4pack_mm_for_cpu`` (the kernel alone),
so "int4 Python side" is the projection less its kernel.  Each row is the mean per step of one run; the runs
are printed side by side (the machine may be shared: compare runs, not single numbers).

``--floor`` adds two rows that bound what the step could become: the same steps with the int4 kernel replaced
by a zero result of its shape (everything else as shipped, this tool's timing wrappers included: well under
1 % of a step; the tokens are then garbage, the work per step is not), and the step's int4 calls alone on the
model's own packed weights with the rows the engine sends (two bf16 rows for fp32 activations:
``quant/gguf_int4pack.py``), nothing between them.
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


_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu  # the op itself, whatever run() wraps


def _zero_int4(x, packed, group, scales_zeros):
    return torch.zeros(x.shape[0], scales_zeros.shape[1], dtype=x.dtype)


def run(steps: int, floor: bool = False) -> dict[str, float]:
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
        tokens = steps * (2 if floor else 1) + 13
        engine.add_request("p", prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        for _ in range(12):  # the prefill and 11 decode steps
            engine.step()
        acc.clear()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
        acc = collections.Counter(acc)  # the timed steps' sums, before the floor's steps add to the wrappers'
        if floor:
            extra = _floor(engine, steps)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        engine.close()
    kernel, projection = acc.pop("_weight_int4pack_mm_for_cpu"), acc.pop("forward")
    parts = {"step": total, "int4 kernel": kernel, "int4 Python side": projection - kernel}
    parts.update(acc)
    parts["rest (embedding, logits' Python side, sampling, engine)"] = total - projection - sum(acc.values())
    if floor:
        parts.update(extra)
    return {k: v / steps * 1e3 for k, v in parts.items()}


def _floor(engine, steps: int) -> dict[str, float]:
    """Seconds for ``steps`` steps with the int4 kernel replaced by zeros, and for ``steps`` steps' int4 calls
    alone (see the module doc)."""
    from anygpu.nn.linear_gguf import GGUFLinear
    from anygpu.quant.gguf_int4pack import GROUP

    timed = torch.ops.aten._weight_int4pack_mm_for_cpu  # run's timing wrapper, put back after
    torch.ops.aten._weight_int4pack_mm_for_cpu = _zero_int4
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        without = time.perf_counter() - start
    finally:
        torch.ops.aten._weight_int4pack_mm_for_cpu = timed
    calls = [(packed, sz) for m in engine.model.modules() if isinstance(m, GGUFLinear)
             for packed, sz, _ in m.segments()]
    xs = {packed.shape[1] * 2: torch.randn(2, packed.shape[1] * 2).bfloat16() for packed, _ in calls}
    start = time.perf_counter()
    for _ in range(steps):
        for packed, sz in calls:
            _INT4_MM(xs[packed.shape[1] * 2], packed, GROUP, sz)
    alone = time.perf_counter() - start
    return {"floor: step without the int4 kernel": without, "floor: the int4 calls alone": alone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--floor", action="store_true", help="also the step without the int4 kernel, and the "
                        "int4 calls alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [run(args.steps, args.floor) for _ in range(args.repeats)]
    print(f"ms per decode step, {args.repeats} runs; capability {torch.backends.cpu.get_cpu_capability()}")
    for key in runs[0]:
        print(f"| {key} | " + " | ".join(f"{r[key]:.1f}" for r in runs) + " |")


if __name__ == "__main__":
    main()
