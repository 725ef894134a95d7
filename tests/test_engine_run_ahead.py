"""Greedy decode steps run ahead (issue 27: overlap host and device): while the device runs step n, the engine has
already launched step n + 1 with step n's argmax as its input ids, and turns step n's tokens into outputs while
n + 1 runs.  A sequence that step n finishes computes one token in vain, which nothing reads.

The CPU has no asynchronous launch, but the bookkeeping is the same there (``engine.run_ahead = True``), so these
tests pin it on the CPU: every request's tokens, text and finish reason equal those of the same engine stepping
one step at a time, through staggered lengths, stop ids and strings, EOS, aborts, requests arriving mid-run,
sampled and logprob requests beside greedy ones, and a KV cache too small for everyone (preemption); every KV
block comes back; steps really ran ahead.  On a GPU (through the decode graphs) the same comparison in fp32 and
bf16.

    .venv/bin/python -m pytest -q tests/test_engine_run_ahead.py      # the GPU half on a CUDA or ROCm machine
"""

from __future__ import annotations

import dataclasses
import gc
import random

import pytest
import torch

from anygpu.engine import LLMEngine, SamplingParams
from anygpu.engine.model_runner import HEADER
from anygpu.models import ModelConfig
from anygpu.models.tokenizer import Tokenizer

CONFIG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position=256, tie_word_embeddings=False, attention_bias=False,
                     sliding_window=None, bos_token_id=1, eos_token_ids=(2,), dtype=None)


def make(run_ahead: bool, **kw) -> LLMEngine:
    torch.manual_seed(0)
    args = dict(device="cpu", max_num_seqs=6, max_num_batched_tokens=64, max_model_len=160, progress=False)
    args.update(kw)
    engine = LLMEngine("tiny", config=CONFIG, tokenizer=Tokenizer.synthetic(CONFIG.vocab_size, 2), **args)
    engine.run_ahead = run_ahead
    return engine


def spy(engine: LLMEngine) -> list:
    """Records each launch_greedy call: True when it ran ahead of a step in flight."""
    calls = []
    launch = engine.runner.launch_greedy

    def spied(batch, after=None):
        calls.append(after is not None)
        return launch(batch, after)

    engine.runner.launch_greedy = spied
    return calls


def run(engine: LLMEngine, arrivals: dict[int, list], aborts: dict[int, list[str]] | None = None) -> dict:
    """Requests added before the step of their key, aborts before theirs; request id -> final output fields."""
    aborts = aborts or {}
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, dataclasses.replace(params))
        for request_id in aborts.get(step, []):
            engine.abort(request_id)
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
        step += 1
        assert step < 2000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # every block came back
    return done


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def preemptions(engine: LLMEngine) -> list:
    """Records each sequence the scheduler preempts."""
    seen = []
    preempt = engine.scheduler._preempt

    def spied(seq, batch):
        seen.append(seq.seq_id)
        return preempt(seq, batch)

    engine.scheduler._preempt = spied
    return seen


def both(arrivals, aborts=None, **kw) -> tuple[dict, list, int]:
    """(outputs stepping one at a time, the run-ahead engine's launches, preemptions); the outputs running ahead
    are the same, after as many preemptions."""
    engine = make(False, **kw)
    preempted = preemptions(engine)
    want = run(engine, arrivals, aborts)
    engine = make(True, **kw)
    calls, preempted_ahead = spy(engine), preemptions(engine)
    got = run(engine, arrivals, aborts)
    assert got == want
    assert len(preempted_ahead) == len(preempted)
    return want, calls, len(preempted)


def test_greedy_batch_with_staggered_lengths_runs_ahead():
    rng = random.Random(0)
    arrivals = {0: [(f"r{i}", p, greedy(rng.randint(1, 30), ignore_eos=True)) for i, p in enumerate(prompts(rng, 5))]}
    want, calls, _ = both(arrivals)
    assert sorted(len(v[0]) for v in want.values()) == sorted(a[2].max_tokens for a in arrivals[0])
    assert sum(calls) >= 20  # most decode steps were launched ahead of the one before


def test_one_sequence_runs_ahead_every_step():
    arrivals = {0: [("solo", [5, 6, 7], greedy(40, ignore_eos=True))]}
    got, calls, _ = both(arrivals)
    assert len(got["solo"][0]) == 40
    assert calls.count(True) == 39 and calls.count(False) == 1  # the prefill's step is sampled, then every decode


def test_stop_ids_strings_and_eos_end_early_and_the_extra_token_is_dropped():
    rng = random.Random(1)
    ps = prompts(rng, 4)
    probe = run(make(False), {0: [(f"r{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(ps)]})
    texts = {k: v[1] for k, v in probe.items()}
    ids = {k: v[0] for k, v in probe.items()}
    arrivals = {0: [("r0", ps[0], greedy(30, ignore_eos=True, stop_token_ids=[ids["r0"][6]])),
                    ("r1", ps[1], greedy(30, ignore_eos=True, stop=[texts["r1"][10:14]])),
                    ("r2", ps[2], greedy(30)),  # EOS (id 2) may or may not come; equal either way
                    ("r3", ps[3], greedy(30, ignore_eos=True, stop=[texts["r3"][3:9]], include_stop_str_in_output=True))]}
    want, calls, _ = both(arrivals)
    assert len(want["r0"][0]) <= 7 and want["r0"][2] == "stop"
    assert want["r1"][2] == "stop" and want["r3"][2] == "stop"
    assert any(calls)


def test_aborts_and_arrivals_mid_run():
    rng = random.Random(2)
    ps = prompts(rng, 7)
    arrivals = {0: [(f"r{i}", ps[i], greedy(25, ignore_eos=True)) for i in range(3)],
                5: [("r3", ps[3], greedy(12, ignore_eos=True))],
                9: [("r4", ps[4], greedy(20, ignore_eos=True)), ("r5", ps[5], greedy(15, ignore_eos=True))],
                30: [("r6", ps[6], greedy(5, ignore_eos=True))]}
    aborts = {7: ["r1"], 12: ["r5", "unknown"]}
    want, calls, _ = both(arrivals, aborts)
    assert "r1" not in want and "r5" not in want and len(want["r0"][0]) == 25 and len(want["r6"][0]) == 5
    assert sum(calls) >= 10


def test_sampled_and_logprob_requests_beside_greedy_ones():
    rng = random.Random(3)
    ps = prompts(rng, 4)
    arrivals = {0: [("g", ps[0], greedy(20, ignore_eos=True)),
                    ("s", ps[1], SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)),
                    ("l", ps[2], greedy(20, ignore_eos=True, logprobs=2))],
                15: [("g2", ps[3], greedy(30, ignore_eos=True))]}
    want, calls, _ = both(arrivals)
    assert len(want["l"][4]) == 20
    assert any(calls)  # once only greedy requests are left, steps run ahead


def test_a_cache_too_small_for_everyone_preempts_the_same_way():
    rng = random.Random(4)
    arrivals = {0: [(f"r{i}", p, greedy(40, ignore_eos=True)) for i, p in enumerate(prompts(rng, 6))]}
    want, calls, preempted = both(arrivals, num_kv_blocks=14, block_size=8, max_model_len=100)
    assert all(len(v[0]) == 40 for v in want.values())
    assert preempted >= 2 and any(calls)


def test_pack_ahead_is_one_position_further():
    engine = make(True)
    engine.add_request("a", [5, 6, 7, 8], greedy(10, ignore_eos=True))
    engine.step()  # the prefill: the sequence now decodes from position 4
    seq = engine.requests["a"].seq
    batch = engine.scheduler.schedule()
    now, _, _ = engine.runner.pack(batch)
    ahead, _, _ = engine.runner.pack(batch, ahead=True)
    head = HEADER  # then ids, positions, slots, cu_seqlens, seqlens_k
    assert now[head:head + 3].tolist() == [seq.last_token, 4, now[head + 2].item()]
    assert ahead[head:head + 3].tolist() == [0, 5, now[head + 2].item() + 1]
    assert ahead[head + 5].item() == now[head + 5].item() + 1  # seqlens_k
    assert now[HEADER - 1].item() == 0 and ahead[HEADER - 1].item() == 1  # ids from the step executed last


def test_tensor_parallel_workers_run_ahead_too():
    """Over gloo (a spawned worker): the worker takes a step run ahead's ids from its own last step, as rank 0."""
    rng = random.Random(6)
    ps = prompts(rng, 3)
    arrivals = {0: [(f"r{i}", ps[i], greedy(12 + 5 * i, ignore_eos=True)) for i in range(3)]}
    want = run(make(False), arrivals)
    engine = make(True, tp=2)
    try:
        calls = spy(engine)
        assert run(engine, arrivals) == want
        assert sum(calls) >= 10
    finally:
        engine.close()


# -- on a GPU ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (decode graphs)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_tokens_equal_stepping_one_at_a_time(dtype):
    rng = random.Random(5)
    ps = prompts(rng, 6)
    arrivals = {0: [(f"r{i}", ps[i], greedy(rng.randint(5, 40), ignore_eos=True)) for i in range(4)],
                8: [("r4", ps[4], greedy(20, ignore_eos=True))],
                20: [("r5", ps[5], SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True))]}
    outs = []
    for run_ahead in (False, True):
        engine = LLMEngine("tiny", config=CONFIG, tokenizer=Tokenizer.synthetic(CONFIG.vocab_size, 2), device="cuda",
                           dtype=dtype, max_num_seqs=8, max_model_len=160, num_kv_blocks=64, progress=False)
        try:
            assert engine.run_ahead and engine.runner.graphs
            engine.run_ahead = run_ahead
            calls = spy(engine)
            outs.append(run(engine, arrivals, {10: ["r2"]}))
            assert sum(calls) >= (10 if run_ahead else 0)
        finally:
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    assert outs[0] == outs[1]
