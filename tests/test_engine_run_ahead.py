"""Decode steps run ahead (issue 27: overlap host and device): while the device runs step n, the engine has already
launched step n + 1 with step n's tokens (argmax, or sampled on the device) as its input ids, and turns step n's
tokens into outputs while n + 1 runs.  A sequence that step n finishes computes one token in vain, which nothing
reads.

The CPU has no asynchronous launch, but the bookkeeping is the same there (``engine.run_ahead = True``), so these
tests pin it on the CPU: every request's tokens, text and finish reason equal those of the same engine stepping
one step at a time, through staggered lengths, stop ids and strings, EOS, aborts, requests arriving mid-run,
sampled and logprob requests beside greedy ones, seeded sampling (top-k, top-p, min-p) running ahead, a launch
whose sampling fails, and a KV cache too small for everyone (preemption); every KV block comes back; steps really
ran ahead; what may not run ahead (penalties, grammars, log-probabilities; sampling under tensor parallelism)
does not.  On a GPU (through the decode graphs) the same comparison in fp32 and bf16, and sampled launches that
never wait for the device.

    .venv/bin/python -m pytest -q tests/test_engine_run_ahead.py      # the GPU half on a CUDA or ROCm machine
"""

from __future__ import annotations

import contextlib
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
    """Records each launch call: True when it ran ahead of a step in flight."""
    calls = []
    launch = engine.runner.launch

    def spied(batch, after=None):
        calls.append(after is not None)
        return launch(batch, after)

    engine.runner.launch = spied
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


def sampled(max_tokens: int, seed: int | None = None, temperature: float = 0.8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **kw)


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


def test_seeded_sampled_requests_run_ahead_with_the_same_tokens():
    rng = random.Random(7)
    ps = prompts(rng, 6)
    arrivals = {0: [("t", ps[0], sampled(30, seed=1, ignore_eos=True)),
                    ("k", ps[1], sampled(25, seed=2, top_k=20, ignore_eos=True)),
                    ("p", ps[2], sampled(20, seed=3, top_p=0.9, ignore_eos=True)),
                    ("m", ps[3], sampled(28, seed=4, temperature=1.3, min_p=0.05, ignore_eos=True)),
                    ("g", ps[4], greedy(15, ignore_eos=True))],
                6: [("e", ps[5], sampled(22, seed=5))]}  # may end at EOS: equal either way
    want, calls, _ = both(arrivals)
    assert [len(want[r][0]) for r in "tkpmg"] == [30, 25, 20, 28, 15]
    assert sum(calls) >= 15


def test_unseeded_sampled_requests_run_ahead():
    """Unseeded draws come from the global generator, which a finished row's vain token also draws from: their
    tokens are not compared, only that every request gets its tokens and its finish."""
    rng = random.Random(8)
    engine = make(True)
    calls = spy(engine)
    got = run(engine, {0: [(f"u{i}", p, sampled(20, top_p=0.95, ignore_eos=True)) for i, p in enumerate(prompts(rng, 4))]})
    assert all(len(v[0]) == 20 and v[2] == "length" and all(0 <= t < CONFIG.vocab_size for t in v[0])
               for v in got.values())
    assert sum(calls) >= 15


@pytest.mark.parametrize("params", [sampled(12, seed=1, repetition_penalty=1.3, ignore_eos=True),
                                    sampled(12, seed=1, frequency_penalty=0.5, ignore_eos=True),
                                    greedy(12, presence_penalty=0.5, ignore_eos=True),
                                    greedy(12, logprobs=1, ignore_eos=True)],
                         ids=["repetition", "frequency", "presence", "logprobs"])
def test_steps_that_read_the_tokens_so_far_or_return_logprobs_do_not_run_ahead(params):
    want, calls, _ = both({0: [("x", [5, 6, 7], params)]})
    assert len(want["x"][0]) == 12 and calls == []


def test_which_rows_sample_without_history():
    from anygpu.engine.sampler import samples_without_history
    from anygpu.engine.sequence import Sequence

    for params in (greedy(4), sampled(4, seed=3, top_k=5, top_p=0.9, min_p=0.1), sampled(4)):
        assert samples_without_history([Sequence([5], params)])
    for params in (sampled(4, repetition_penalty=1.1), greedy(4, frequency_penalty=0.2),
                   greedy(4, presence_penalty=-0.2), sampled(4, logprobs=0)):
        assert not samples_without_history([Sequence([5], params)])
    guided = Sequence([5], greedy(4))
    guided.guide = object()  # a grammar's state lives on the host
    assert not samples_without_history([Sequence([5], greedy(4)), guided])


def test_sampled_steps_do_not_run_ahead_under_tensor_parallelism():
    """A worker takes a step run ahead's ids from its own argmax: only greedy batches qualify there."""
    from anygpu.engine.scheduler import ScheduledBatch

    engine = make(True)
    engine.add_request("s", [5, 6, 7], sampled(5, seed=1, ignore_eos=True))
    engine.add_request("g", [5, 6, 8], greedy(5, ignore_eos=True))
    engine.step()  # both prefills
    batch = engine.scheduler.schedule()
    assert engine.runner.can_launch(batch)
    greedy_only = ScheduledBatch([engine.requests["g"].seq], [1], needs_logits=[True])
    engine.runner.workers = object()  # what rank 0 holds under tensor parallelism (can_launch only looks at it)
    try:
        assert not engine.runner.can_launch(batch)
        assert engine.runner.can_launch(greedy_only)
    finally:
        engine.runner.workers = None


def test_a_launch_whose_sampling_fails_runs_scheduled_with_the_same_draws():
    """Sampling raises after the seeded generators drew: they are put back, the step runs scheduled, and every
    token equals stepping one at a time."""
    rng = random.Random(9)
    ps = prompts(rng, 3)
    arrivals = {0: [(f"r{i}", ps[i], sampled(18, seed=10 + i, top_k=30, ignore_eos=True)) for i in range(3)]}
    want = run(make(False), arrivals)
    engine = make(True)
    real, count = engine.runner.sampler.sample_tensor, [0]

    def flaky(logits, seqs, greedy=None):
        tokens = real(logits, seqs, greedy)  # the draws are made
        count[0] += 1
        if count[0] in (4, 9):
            raise RuntimeError("injected after drawing")
        return tokens

    engine.runner.sampler.sample_tensor = flaky
    calls = spy(engine)
    assert run(engine, arrivals) == want
    assert count[0] > 10 and sum(calls) >= 8


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

@contextlib.contextmanager
def gpu_engine(dtype: str):
    """The tiny engine on the GPU (decode graphs), closed and its memory given back afterwards."""
    engine = LLMEngine("tiny", config=CONFIG, tokenizer=Tokenizer.synthetic(CONFIG.vocab_size, 2), device="cuda",
                       dtype=dtype, max_num_seqs=8, max_model_len=160, num_kv_blocks=64, progress=False)
    try:
        yield engine
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


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
        with gpu_engine(dtype) as engine:
            assert engine.run_ahead and engine.runner.graphs
            engine.run_ahead = run_ahead
            calls = spy(engine)
            outs.append(run(engine, arrivals, {10: ["r2"]}))
            assert sum(calls) >= (10 if run_ahead else 0)
    assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (decode graphs)")
def test_gpu_sampled_steps_run_ahead_without_waiting_for_the_device():
    """Seeded sampled requests (top-k, top-p) beside a greedy one: the same tokens as stepping one at a time, and
    no launch (its pack, replay, sampling and copy out) synchronizes with the device: under
    ``torch.cuda.set_sync_debug_mode("error")`` any such call raises."""
    rng = random.Random(11)
    ps = prompts(rng, 5)
    arrivals = {0: [(f"s{i}", ps[i], sampled(rng.randint(10, 30), seed=i, top_k=50, top_p=0.95, ignore_eos=True))
                    for i in range(4)] + [("g", ps[4], greedy(25, ignore_eos=True))]}
    outs = []
    for run_ahead in (False, True):
        with gpu_engine("float32") as engine:
            engine.run_ahead = run_ahead
            launch, errors = engine.runner.launch, []

            def strict(batch, after=None, launch=launch, errors=errors):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return launch(batch, after)
                except Exception as error:
                    errors.append(error)
                    raise
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            engine.runner.launch = strict
            calls = spy(engine)
            outs.append(run(engine, arrivals))
            assert not errors, errors[:1]
            assert sum(calls) >= (15 if run_ahead else 0)
    assert outs[0] == outs[1]
