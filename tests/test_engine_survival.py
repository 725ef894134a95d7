"""No one request can stop the engine: a failure injected into one request's sampling (or into a forward that
holds it) ends that request with finish_reason "error", and the requests running beside it finish with exactly
the tokens they get when nothing fails, in this process (``LLMEngine``, ``AsyncLLMEngine``) and in the engine
process (``EngineClient``).  An engine that fails for every sequence is dead, and says so (``healthy``,
``wait_dead``, ``EngineDead``, the engine process's exit status)."""

from __future__ import annotations

import asyncio
import functools

import pytest

from anygpu.bench.model import random_engine
from anygpu.engine import AsyncLLMEngine, SamplingParams
from anygpu.engine.engine_process import EngineClient
from anygpu.engine.errors import EngineDead, RequestFailed, RequestInvalid

POISON = [7, 7, 7, 7]  # a prompt that the injected faults below recognise
PROMPTS = {"a": [100, 200, 300], "b": [400, 500], "c": [600, 700, 800, 900]}
PARAMS = {"a": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          "b": SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True),
          "c": SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=99, ignore_eos=True)}


def poisoned(seqs) -> bool:
    return any(s.prompt_token_ids == POISON for s in seqs)


def poison_sampler(engine, error: type[Exception] = RuntimeError):
    """Make sampling raise whenever the poisoned request is among the rows (as a real per-request fault would:
    alone or in any batch)."""
    sample = engine.runner.sampler.sample

    def faulty(logits, seqs):
        if poisoned(seqs):
            raise error("injected: sampling failed")
        return sample(logits, seqs)

    engine.runner.sampler.sample = faulty
    return engine


def poison_forward(engine):
    """Make the whole forward raise whenever the poisoned request is in the batch."""
    run = engine.runner.run

    def faulty(batch):
        if poisoned(batch.seqs):
            raise RuntimeError("injected: forward failed")
        return run(batch)

    engine.runner.run = faulty
    return engine


def broken_forward(engine):
    def broken(batch):
        raise RuntimeError("injected: device lost")

    engine.runner.run = broken
    return engine


def make_engine(fault=None, **kwargs):
    """Top level (and a partial of it): an EngineClient's factory must pickle."""
    engine = random_engine("tiny", max_num_seqs=8, progress=False, **kwargs)
    return fault(engine) if fault is not None else engine


def run_all(engine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params.clone())
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def reference() -> dict:
    """The tokens of a, b and c when nothing fails."""
    engine = make_engine()
    outs = run_all(engine, {rid: (PROMPTS[rid], PARAMS[rid]) for rid in PROMPTS})
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


def with_poison(params: SamplingParams | None = None) -> dict:
    requests = {rid: (PROMPTS[rid], PARAMS[rid]) for rid in PROMPTS}
    requests["bad"] = (POISON, params or SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True))
    return requests


@pytest.mark.parametrize("fault, error_type", [
    (poison_sampler, "internal"),
    (functools.partial(poison_sampler, error=ValueError), "invalid_request"),
    (poison_forward, "internal"),
])
def test_one_failing_request_ends_alone(reference, fault, error_type):
    engine = make_engine(fault)
    outs = run_all(engine, with_poison())
    bad = outs["bad"]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and bad.error_type == error_type
    assert "injected" in bad.error
    for rid in PROMPTS:
        assert outs[rid].outputs[0].finish_reason == "length" and outs[rid].outputs[0].token_ids == reference[rid], rid
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.requests


def test_a_request_that_fails_later_keeps_its_tokens_so_far_and_frees_its_blocks(reference):
    """The fault hits after some tokens (a greedy poisoned request is fine until its 4th token)."""
    engine = make_engine()
    sample = engine.runner.sampler.sample

    def faulty(logits, seqs):
        if any(s.prompt_token_ids == POISON and s.num_output_tokens >= 3 for s in seqs):
            raise RuntimeError("injected: late failure")
        return sample(logits, seqs)

    engine.runner.sampler.sample = faulty
    outs = run_all(engine, with_poison(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    assert outs["bad"].outputs[0].finish_reason == "error" and len(outs["bad"].outputs[0].token_ids) == 3
    assert all(outs[rid].outputs[0].token_ids == reference[rid] for rid in PROMPTS)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_failing_detokenizer_ends_only_its_request(reference):
    """A fault in the text side of one request (here its detokenizer) ends it alone too."""
    engine = make_engine()
    for rid, (prompt, params) in with_poison().items():
        engine.add_request(rid, prompt, params.clone())

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    engine.requests["bad"].detok.add = broken
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    # A ValueError: the request's own fault.
    assert done["bad"].outputs[0].finish_reason == "error" and done["bad"].error_type == "invalid_request"
    assert all(done[rid].outputs[0].token_ids == reference[rid] for rid in PROMPTS)


async def _generate_all(engine: AsyncLLMEngine, requests: dict) -> dict:
    async def one(rid, prompt, params):
        last = None
        try:
            async for out in engine.generate(rid, prompt, params.clone()):
                last = out
        except Exception as error:  # noqa: BLE001 - the failure is the result under test
            return error
        return last
    results = await asyncio.gather(*(one(rid, p, s) for rid, (p, s) in requests.items()))
    return dict(zip(requests, results))


@pytest.mark.parametrize("in_process", [True, False], ids=["thread", "engine-process"])
def test_async_engine_fails_one_stream_and_serves_the_rest(reference, in_process):
    factory = functools.partial(make_engine, poison_sampler)
    engine = AsyncLLMEngine(factory() if in_process else EngineClient(factory))
    try:
        outs = asyncio.run(_generate_all(engine, with_poison()))
        assert isinstance(outs["bad"], RequestFailed) and "injected: sampling failed" in str(outs["bad"])
        for rid in PROMPTS:
            done = outs[rid].outputs[0]
            assert done.finish_reason == "length" and done.token_ids == reference[rid], rid
        assert engine.healthy and engine.error is None
        # It goes on serving, and a parameter fault is a ValueError (a 4xx at the HTTP layer).
        again = asyncio.run(_generate_all(engine, {"a2": (PROMPTS["a"], PARAMS["a"])}))
        assert again["a2"].outputs[0].token_ids == reference["a"]
    finally:
        engine.shutdown()
        if not in_process:
            engine.engine.close()


def test_engine_process_reports_a_parameter_fault_as_invalid():
    factory = functools.partial(make_engine, functools.partial(poison_sampler, error=ValueError))
    client = EngineClient(factory)
    engine = AsyncLLMEngine(client)
    try:
        outs = asyncio.run(_generate_all(engine, {"bad": (POISON, PARAMS["b"]), "a": (PROMPTS["a"], PARAMS["a"])}))
        assert isinstance(outs["bad"], RequestInvalid) and isinstance(outs["bad"], ValueError)
        assert outs["a"].outputs[0].finish_reason == "length" and engine.healthy
    finally:
        engine.shutdown()
        client.close()


@pytest.mark.parametrize("in_process", [True, False], ids=["thread", "engine-process"])
def test_an_engine_that_fails_for_everyone_is_dead_and_says_so(in_process):
    factory = functools.partial(make_engine, broken_forward)
    engine = AsyncLLMEngine(factory() if in_process else EngineClient(factory))

    async def scenario():
        waiter = asyncio.ensure_future(engine.wait_dead())
        outs = await _generate_all(engine, {"a": (PROMPTS["a"], PARAMS["a"]), "b": (PROMPTS["b"], PARAMS["b"])})
        cause = await asyncio.wait_for(waiter, 30)
        later = await _generate_all(engine, {"c": (PROMPTS["c"], PARAMS["c"])})
        return outs, cause, later, await engine.wait_dead()

    try:
        outs, cause, later, again = asyncio.run(scenario())
        assert all(isinstance(e, EngineDead) and "device lost" in str(e) for e in outs.values()), outs
        assert "device lost" in str(cause) and again is cause and engine.error is cause
        assert isinstance(later["c"], EngineDead)  # a request after the death fails at once, never hangs
        assert not engine.healthy and engine.dead.is_set()
        if not in_process:
            engine.engine._proc.join(timeout=30)
            assert engine.engine._proc.exitcode == 1  # the engine process exits non-zero
    finally:
        engine.shutdown()
        if not in_process:
            engine.engine.close()


def test_shutdown_fails_waiting_requests_instead_of_hanging():
    engine = AsyncLLMEngine(make_engine())
    engine.shutdown()
    outs = asyncio.run(_generate_all(engine, {"a": (PROMPTS["a"], PARAMS["a"])}))
    assert isinstance(outs["a"], EngineDead) and engine.error is None and not engine.dead.is_set()


def test_cli_stream_reports_a_request_that_failed_alone():
    """`anygpu generate` prints the failure and exits 1 instead of a summary line as if it had worked."""
    import click

    from anygpu.cli.generate import _stream

    engine = poison_sampler(random_engine("tiny", max_model_len=64))
    try:
        with pytest.raises(click.ClickException, match="generation failed: .*injected: sampling failed"):
            _stream(engine, "x", POISON, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert _stream(engine, "y", PROMPTS["a"], PARAMS["a"]).finish_reason == "length"  # the engine steps on
    finally:
        engine.close()
