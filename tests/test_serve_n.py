"""``n`` > 1 (issue 24): several completions of one prompt, as OpenAI's API shapes them (choices indexed
0..n-1, usage counting every choice's tokens, stream chunks naming their choice), on the default model through
a real server and the real OpenAI client; vLLM's offline shape (``outputs`` with n entries) on a tiny Llama.
With a seed the choices differ and repeat exactly (choice i samples with seed + i, so choice 0 is the n = 1
answer); one failing choice fails its request alone and the engine serves on."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from anygpu import LLM
from anygpu.bench.model import random_config, random_engine
from anygpu.engine import AsyncLLMEngine, SamplingParams
from anygpu.engine.sampling_params import MAX_N
from anygpu.serve import ServerThread, build_app

from ._models_fixtures import smollm_path  # noqa: F401 - fixture
from ._serve_fixtures import client, engine, server  # noqa: F401 - fixtures

openai = pytest.importorskip("openai")

PROMPT = "Once upon a time"
SAMPLED = dict(max_tokens=8, temperature=1.0, seed=1234)


def test_completions_n_choices_differ_repeat_and_count(client, engine):
    r = client.completions.create(model="m", prompt=PROMPT, n=4, extra_body={"ignore_eos": True}, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 4, texts  # four seeds: four different samples
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 4 * 8
    assert r.usage.prompt_tokens == len(engine.engine.tokenizer.encode(PROMPT))
    again = client.completions.create(model="m", prompt=PROMPT, n=4, extra_body={"ignore_eos": True}, **SAMPLED)
    assert [c.text for c in again.choices] == texts
    one = client.completions.create(model="m", prompt=PROMPT, extra_body={"ignore_eos": True}, **SAMPLED)
    assert one.choices[0].text == texts[0]
    assert not engine.engine.requests  # every child request ended


def test_chat_n_stream_chunks_name_their_choice(client):
    messages = [{"role": "user", "content": "Name a color."}]
    plain = client.chat.completions.create(model="m", messages=messages, n=3, **SAMPLED)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    chunks = list(client.chat.completions.create(model="m", messages=messages, n=3, stream=True,
                                                 stream_options={"include_usage": True}, **SAMPLED))
    texts, reasons, roles = ["", "", ""], [None] * 3, [0] * 3
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk, as OpenAI streams
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason is not None:
            assert reasons[choice.index] is None
            reasons[choice.index] = choice.finish_reason
    assert roles == [1, 1, 1]
    assert texts == [c.message.content for c in plain.choices]
    assert reasons == [c.finish_reason for c in plain.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_greedy_n_gives_n_equal_choices(client):
    r = client.completions.create(model="m", prompt=PROMPT, n=2, max_tokens=5, temperature=0)
    assert r.choices[0].text == r.choices[1].text and r.usage.completion_tokens == 10


@pytest.mark.parametrize("n", [0, MAX_N + 1, "2"])
def test_n_out_of_range_is_a_400_naming_n(server, n):
    for route, body in (("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = httpx.post(server.url + route, json={**body, "n": n, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_n_at_the_limit_runs(client):
    r = client.completions.create(model="m", prompt="Hi", n=MAX_N, max_tokens=1, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == list(range(MAX_N)) and r.usage.completion_tokens == MAX_N


# -- one failing choice ---------------------------------------------------------------------------------------
BAD_SEED = 1001  # choice 1 of a request with seed 1000


def poison_seed(engine):
    """Sampling raises for the row of the sequence seeded BAD_SEED, alone or in any batch (as a real fault of one
    request would)."""
    sample = engine.runner.sampler.sample

    def faulty(logits, seqs):
        if any(s.params.seed == BAD_SEED for s in seqs):
            raise RuntimeError("injected: sampling failed")
        return sample(logits, seqs)

    engine.runner.sampler.sample = faulty
    return engine


@pytest.fixture(scope="module")
def faulty_server():
    engine = AsyncLLMEngine(poison_seed(random_engine("tiny", max_num_seqs=8, progress=False)))
    with ServerThread(build_app(engine)) as s:
        yield s, engine
    engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_one_failing_choice_fails_the_request_alone(faulty_server, stream):
    server, engine = faulty_server
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json={**body, "n": 3, "seed": 1000, "stream": stream})
    if stream:
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and "injected" in events[-2] and events[-1] == "[DONE]"
    else:
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    assert engine.healthy
    ok = httpx.post(server.url + "/v1/completions", json={**body, "n": 2, "seed": 2000})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    assert not engine.engine.requests and engine.engine.block_manager.num_free_blocks == \
        engine.engine.block_manager.num_blocks  # the siblings of the failed choice were aborted


# -- the offline API ------------------------------------------------------------------------------------------
def test_offline_generate_returns_n_outputs():
    llm = LLM("tiny", config=random_config("tiny"), progress=False)
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=77, ignore_eos=True)
    (out,) = llm.generate([[5, 6, 7]], params)
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    (again,) = llm.generate([[5, 6, 7]], params.clone())
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    (one,) = llm.generate([[5, 6, 7]], params.clone(n=1))
    assert one.outputs[0].token_ids == out.outputs[0].token_ids and len(one.outputs) == 1
    with pytest.raises(ValueError, match="n: expected an int in"):
        SamplingParams(n=MAX_N + 1)
    with pytest.raises(ValueError, match="^n: an engine request runs one completion"):
        llm.engine.add_request("direct", [5, 6, 7], SamplingParams(n=2))


LONG = list(range(10, 80))  # several full KV blocks


def test_choices_share_the_prompt_blocks_offline_and_served():
    """Choices after the first start once its prompt is in the prefix cache, so they find it there."""
    llm = LLM("tiny", config=random_config("tiny"), progress=False, block_size=16)
    (out,) = llm.generate([LONG], SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=1, ignore_eos=True))
    assert out.num_cached_tokens == 64 and len(out.outputs) == 3  # 4 of the prompt's 4 full blocks (70 tokens)
    engine = AsyncLLMEngine(random_engine("tiny", block_size=16, progress=False))

    async def run():
        return [o async for o in engine.generate("r", LONG, SamplingParams(n=3, max_tokens=3, seed=1,
                                                                          ignore_eos=True))]
    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert outs[-1].finished and outs[-1].num_cached_tokens == 64
    assert [len(c.token_ids) for c in outs[-1].outputs] == [3, 3, 3]
    streamed = [[t for o in outs for t in o.outputs[i].delta_token_ids] for i in range(3)]
    assert streamed == [c.token_ids for c in outs[-1].outputs]  # the deltas add up to each choice
