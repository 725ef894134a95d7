"""The engine's host (Python) time per decode step, by part, on the CPU with a tiny random Llama.

    python3 tools/profile_engine_host.py [--batch 1 64] [--repeats 5] [--cprofile]

A model of hidden size 64 and 2 layers makes the forward nearly free, so what a step costs is the host work the
GPU would wait on: the scheduler, ``ModelRunner.pack``, the forward (``execute``), the sampler, and the engine's
bookkeeping (``Scheduler.update``, detokenization, stop checks, building the outputs).  Each batch size runs
``batch`` prompts of ``--input-len`` tokens for ``--output-len`` greedy tokens (EOS ignored) with the synthetic
word-per-id tokenizer (``anygpu bench model --random-config``'s), and times the decode steps only.  The parts are
timed by wrapping the engine's methods here (nothing is timed inside the engine); the table gives each part's
median over the decode steps of ``--repeats`` runs (medians: the machine may be shared, and a step that another
process interrupted should not count), and the step less ``execute``: the host work a GPU step would wait on.  ``--cprofile`` prints
the functions with the most own time over one more run of each batch size.  ``--tokenizer default`` streams text
through the default model's byte-level BPE (SmolLM2's, installed with the package) instead of the synthetic
words: the model's vocabulary is then the tokenizer's (49152), which makes ``execute`` and ``sample`` larger but
gives the detokenizer a real vocabulary's pieces.  The runs share one tokenizer, as a server's requests do.
``--logprobs K`` asks every request for its tokens' log-probabilities and the K most likely (the sampler's top-k
and the engine's ``Logprob`` entries with their token texts); ``--stop S ...`` gives every request stop strings
(pick ones the text cannot hold: a request that stops early fails the run's token count), so the stop search
and the held-back text are timed too.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import dataclasses
import functools

import torch

from anygpu.bench.model import random_prompts
from anygpu.engine import LLMEngine, SamplingParams
from anygpu.models import ModelConfig
from anygpu.models.tokenizer import Tokenizer

CONFIG = ModelConfig(architecture="llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position=2048, tie_word_embeddings=False, attention_bias=False,
                     sliding_window=None, bos_token_id=1, eos_token_ids=(2,), dtype=None)
PARTS = ("schedule", "pack", "execute", "sample", "update", "output")
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


TOKENIZER = "synthetic"  # --tokenizer; None (--no-tokenizer): no text, to see what detokenization costs
SAMPLING: dict = {}  # --logprobs, --stop: more SamplingParams for every request


@functools.lru_cache(maxsize=None)
def _tokenizer(kind: str | None) -> Tokenizer | None:
    """One tokenizer per kind for all runs, as a server keeps one (its per-token tables stay filled)."""
    global CONFIG
    if kind is None:
        return None
    if kind == "synthetic":
        return Tokenizer.synthetic(CONFIG.vocab_size, 2)
    from anygpu.models import GGUFCheckpoint
    from anygpu.models.checkpoint import installed_model_path

    tokenizer = GGUFCheckpoint(installed_model_path()).tokenizer
    CONFIG = dataclasses.replace(CONFIG, vocab_size=tokenizer.vocab_size)
    return tokenizer


def build(batch: int, input_len: int, output_len: int) -> LLMEngine:
    tokenizer = _tokenizer(TOKENIZER)
    torch.manual_seed(0)
    return LLMEngine("tiny-host", config=CONFIG, tokenizer=tokenizer,
                     device="cpu", max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * input_len),
                     max_model_len=input_len + output_len + 16, progress=False)


def _wrap(obj, name: str, totals: dict, part: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] += clock() - t

    setattr(obj, name, timed)  # an instance attribute: the engine's own calls (self.pack(...)) go through it


def run_once(batch: int, input_len: int, output_len: int, profiler: cProfile.Profile | None = None) -> list[dict]:
    """Per decode step, host µs by part (``output``: the step less the timed parts, i.e. the engine's output
    processing and the rest of ``ModelRunner.run``) and the step's total."""
    engine = build(batch, input_len, output_len)
    totals = dict.fromkeys(PARTS + ("step",), 0.0)
    _wrap(engine.scheduler, "schedule", totals, "schedule")
    _wrap(engine.scheduler, "update", totals, "update")
    _wrap(engine.runner, "pack", totals, "pack")
    _wrap(engine.runner, "execute", totals, "execute")
    _wrap(engine.runner.sampler, "sample_each", totals, "sample")
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, **SAMPLING)
    for i, prompt in enumerate(random_prompts(batch, input_len, CONFIG.vocab_size)):
        engine.add_request(str(i), prompt, params)
    engine.step()  # the prefill: every prompt fits the token budget
    for _ in range(3):  # warm up the decode path
        engine.step()
    steps, tokens = [], 0
    if profiler is not None:
        profiler.enable()
    while engine.has_unfinished():
        for k in totals:
            totals[k] = 0.0
        t = clock()
        outs = engine.step()
        totals["step"] = clock() - t
        tokens += sum(len(o.delta_token_ids) for o in outs)
        step = {k: 1e6 * v for k, v in totals.items()}
        step["output"] = step["step"] - sum(step[k] for k in PARTS if k != "output")
        steps.append(step)
    if profiler is not None:
        profiler.disable()
    engine.close()
    if tokens != len(steps) * batch:
        raise RuntimeError(f"expected {batch} new tokens in each decode step, got {tokens} over {len(steps)} steps")
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the forward is tiny; 1 is steadiest)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="cpu: this thread's CPU time (steadier on a busy machine; each reading costs a system call)")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--no-tokenizer", action="store_true", help="token ids only: the engine detokenizes nothing")
    ap.add_argument("--tokenizer", choices=["synthetic", "default"], default="synthetic",
                    help="default: the default model's tokenizer (SmolLM2's byte-level BPE) and its vocabulary size")
    ap.add_argument("--logprobs", type=int, default=None, help="every request's logprobs (top-K): None for none")
    ap.add_argument("--stop", nargs="+", default=[], help="stop strings for every request (ones that never match)")
    args = ap.parse_args()
    if args.logprobs is not None:
        SAMPLING["logprobs"] = args.logprobs
    if args.stop:
        SAMPLING["stop"] = args.stop
    global clock, TOKENIZER
    clock, TOKENIZER = CLOCKS[args.clock], None if args.no_tokenizer else args.tokenizer
    torch.set_num_threads(args.threads)
    cols = PARTS + ("step",)
    print(f"host µs per decode step, median over the decode steps of {args.repeats} runs ('output': the step "
          f"less the other parts; medians, so the parts need not add up to the step)")
    print("| batch | " + " | ".join(cols) + " | step less execute |")
    print("|---" * (len(cols) + 2) + "|")
    for b in args.batch:
        steps = [s for _ in range(args.repeats) for s in run_once(b, args.input_len, args.output_len)]
        med = {k: statistics.median(s[k] for s in steps) for k in cols}
        host = statistics.median(s["step"] - s["execute"] for s in steps)
        print(f"| {b} | " + " | ".join(f"{med[k]:.0f}" for k in cols) + f" | {host:.0f} |")
    if args.cprofile:
        for b in args.batch:
            prof = cProfile.Profile()
            run_once(b, args.input_len, args.output_len, prof)
            print(f"\n-- batch {b}: functions by own time over the decode steps --")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
