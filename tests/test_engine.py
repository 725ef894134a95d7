"""The engine end to end on the CPU with the real default model (SmolLM2-135M-Instruct, fp32): batched, chunked-prefill,
preempted and prefix-cached runs give the same tokens as each request alone; streaming text, stop strings, bad
input, the async engine and the offline API."""

from __future__ import annotations

import asyncio

import pytest

from anygpu.engine import LLM, AsyncLLMEngine, LLMEngine, SamplingParams

from ._models_fixtures import smollm_path  # noqa: F401 - fixture

QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello in Spanish.",
             "What is the largest planet?"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm_path):  # noqa: F811
    from anygpu.models import open_checkpoint

    tok = open_checkpoint(smollm_path).tokenizer
    # A shared system prompt makes the first ~20 tokens common to every prompt: prefix-cache hits.
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def run(engine: LLMEngine, prompts, params=GREEDY, stagger: int = 0) -> dict[str, list[int]]:
    """Run prompts to completion; with ``stagger`` k, prompt i joins after step i * k (continuous batching)."""
    out, step, pending = {}, 0, list(enumerate(prompts))
    while pending or engine.has_unfinished():
        while pending and pending[0][0] * stagger <= step:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
        step += 1
    return out


@pytest.fixture(scope="module")
def alone(smollm_path, prompts):  # noqa: F811
    engine = LLMEngine(str(smollm_path), progress=False, max_num_seqs=1)
    return {str(i): run(engine, [p])["0"] for i, p in enumerate(prompts)}


@pytest.fixture(scope="module")
def engine_factory(smollm_path):  # noqa: F811
    from anygpu.models import open_checkpoint

    ckpt = open_checkpoint(smollm_path)
    weights = list(ckpt.weights(progress=False))  # load the file once for every engine variant

    class Ckpt:
        path, name, config, tokenizer = ckpt.path, ckpt.name, ckpt.config, ckpt.tokenizer

        def weights(self, progress=True):
            return iter(weights)

    def make(**kwargs):
        import anygpu.engine.llm_engine as le

        original = le.open_checkpoint
        le.open_checkpoint = lambda _: Ckpt()
        try:
            return LLMEngine(str(smollm_path), progress=False, **kwargs)
        finally:
            le.open_checkpoint = original

    return make


def test_batched_equals_alone(engine_factory, prompts, alone):
    assert run(engine_factory(max_num_seqs=8), prompts) == alone


def test_continuous_batching_and_chunked_prefill_equal_alone(engine_factory, prompts, alone):
    # A 16-token budget chunks every ~40-token prompt over several steps, mixed with other sequences' decodes.
    engine = engine_factory(max_num_seqs=8, max_num_batched_tokens=16, block_size=8)
    assert run(engine, prompts, stagger=3) == alone


def test_preemption_equals_alone(engine_factory, prompts, alone):
    # 14 blocks of 8 tokens cannot hold five ~50-token sequences: some are preempted and recomputed.
    engine = engine_factory(max_num_seqs=8, block_size=8, num_kv_blocks=14, max_model_len=112)
    preempted = []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        batch = schedule()
        preempted.extend(batch.preempted)
        return batch

    engine.scheduler.schedule = counting_schedule
    assert run(engine, prompts) == alone
    assert preempted


def test_prefix_cache_hits_equal_alone(engine_factory, prompts, alone):
    engine = engine_factory(max_num_seqs=8, block_size=4)
    first = run(engine, prompts[:1])
    engine.add_request("again", prompts[1], GREEDY)
    hits = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                hits, tokens = o.num_cached_tokens, o.outputs[0].token_ids
    assert first["0"] == alone["0"]
    assert tokens == alone["1"]
    assert hits >= 16  # the shared system-prompt blocks came from the cache


def test_stream_text_and_stop_string(engine_factory, prompts):
    engine = engine_factory()
    params = SamplingParams(max_tokens=20, temperature=0, stop=["Paris"])
    engine.add_request("s", prompts[0], params)
    deltas, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            deltas.append(o.outputs[0].delta_text)
            last = o
    assert last.finished and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == "Paris"
    assert last.outputs[0].text == "The capital of France is "
    assert "".join(deltas) == last.outputs[0].text


def test_bad_input_is_rejected_and_others_continue(engine_factory, prompts, alone):
    engine = engine_factory(max_model_len=64)
    engine.add_request("good", prompts[0], GREEDY)
    with pytest.raises(ValueError, match="prompt: 70 tokens"):
        engine.add_request("long", [5] * 70, GREEDY)
    with pytest.raises(ValueError, match="prompt: expected at least one token"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match=r"prompt: token ids must be in \[0, 49152\)"):
        engine.add_request("oov", [1, 49152], GREEDY)
    with pytest.raises(ValueError, match="request_id: 'good' is already running"):
        engine.add_request("good", prompts[1], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("t", prompts[1], SamplingParams(temperature=-1.0))
    engine.add_request("abort-me", prompts[1], GREEDY)
    engine.step()
    engine.abort("abort-me")
    assert engine.block_manager.num_free_blocks < engine.runner.num_blocks
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert out == {"good": alone["0"]}
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_llm_generate_and_chat(engine_factory, prompts, alone):
    llm = LLM.__new__(LLM)
    llm.engine = engine_factory(max_num_seqs=4)
    llm.tokenizer = llm.engine.tokenizer
    import itertools

    llm._ids = itertools.count()
    outs = llm.generate([prompts[0], prompts[2]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [alone["0"], alone["2"]]
    chat = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(max_tokens=16, temperature=0))
    assert chat[0].outputs[0].text == "The capital of France is Paris."
    assert chat[0].outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="sampling_params: expected one per prompt"):
        llm.generate(["a", "b"], [GREEDY])


def test_async_engine_streams_and_aborts_on_disconnect(engine_factory, prompts, alone):
    engine = engine_factory(max_num_seqs=4)
    served = AsyncLLMEngine(engine)

    async def full(i):
        tokens = None
        async for o in served.generate(f"a{i}", prompts[i], GREEDY):
            tokens = o.outputs[0].token_ids
        return tokens

    async def leave_early():
        async for o in served.generate("leaver", prompts[3], SamplingParams(max_tokens=200, temperature=0)):
            if len(o.outputs[0].token_ids) >= 2:
                break  # the client goes away: the request must be aborted

    async def bad():
        with pytest.raises(ValueError, match="top_p"):
            async for _ in served.generate("bad", prompts[0], SamplingParams(top_p=0.0)):
                pass

    async def main():
        results = await asyncio.gather(full(0), full(1), leave_early(), bad())
        for _ in range(100):  # the engine thread frees the leaver's blocks on its next pass
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.05)
        return results

    try:
        results = asyncio.run(main())
    finally:
        served.shutdown()
    assert results[0] == alone["0"] and results[1] == alone["1"]
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
