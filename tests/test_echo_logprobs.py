"""Prompt log-probabilities and ``echo`` (issue 24): the engine's ``SamplingParams.prompt_logprobs`` equal
transformers' log-softmax at every prompt position, fp32 on the CPU, within 1e-4 on a tiny random Llama (in
this process and through the engine process, chunked prefill and prefix cache included); ``/v1/completions``
with ``echo`` returns them in OpenAI's legacy shape (the first token's null), streamed and not, with
``max_tokens`` 0 or 1.  The offline-eval check sends what lm-evaluation-harness's ``local-completions`` sends
for log-likelihood and generate-until tasks to a real server on loopback running the default model, reads the
answers as lm-eval reads them, and compares with transformers computed here."""

from __future__ import annotations

import asyncio
import functools
import json
from operator import itemgetter

import httpx
import pytest
import torch

from anygpu import LLM
from anygpu.engine import AsyncLLMEngine, BlockManager, LLMEngine, SamplingParams, Scheduler, Sequence
from anygpu.engine.engine_process import EngineClient
from anygpu.engine.scheduler import PROMPT_LOGPROBS_CHUNK
from anygpu.serve import ServerThread, build_app

from ._models_fixtures import hf_smollm, smollm_path  # noqa: F401 - fixtures

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

K = 3
PROMPT = [5, 17, 300, 42, 7, 99, 512, 3, 64, 640, 11, 23, 900, 1, 77, 345, 2, 8, 19]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=32, num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=False,
                                   max_position_embeddings=256, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama-echo")
    model.save_pretrained(folder)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    return folder, ref  # ref[j]: the distribution of token j + 1


def check_prompt_logprobs(entries, ref: torch.Tensor, k: int, atol: float = 1e-4) -> None:
    assert len(entries) == len(PROMPT) and entries[0] is None
    for j in range(1, len(PROMPT)):
        tid, entry = PROMPT[j], entries[j]
        assert next(iter(entry)) == tid  # the prompt's token first, as vLLM
        assert abs(entry[tid].logprob - ref[j - 1, tid].item()) <= atol, (j, entry[tid].logprob)
        # The rank within what two fp32 computations can disagree on (near-ties may order either way).
        above = ref[j - 1] - ref[j - 1, tid]
        assert int((above > atol).sum()) + 1 <= entry[tid].rank <= int((above > -atol).sum()), j
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in top]), ref[j - 1].topk(k).values,
                                   atol=atol, rtol=0)


@pytest.mark.parametrize("chunk", [None, 7], ids=["one-prefill", "chunked-prefill"])
def test_engine_prompt_logprobs_equal_transformers(tiny, chunk):
    folder, ref = tiny
    llm = LLM(str(folder), progress=False, block_size=4, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K)
    check_prompt_logprobs(llm.generate(PROMPT, params)[0].prompt_logprobs, ref, K)
    # Again: the prompt's blocks are in the prefix cache now, but the prompt's logits are still computed.
    again = llm.generate(PROMPT, params.clone())[0]
    check_prompt_logprobs(again.prompt_logprobs, ref, K)
    assert again.num_cached_tokens == 0
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still use the cache
    (both,) = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=1.0, seed=3, n=3, prompt_logprobs=0))
    assert len(both.outputs) == 3
    assert [list(e) for e in both.prompt_logprobs[1:]] == [[t] for t in PROMPT[1:]]


def test_prompt_logprobs_prefill_in_bounded_chunks():
    """Their positions' logits are materialised, so such a prompt computes at most PROMPT_LOGPROBS_CHUNK tokens a
    step; other prompts take the whole budget."""
    scheduler = Scheduler(BlockManager(200, 16), max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048)
    wants, plain = (Sequence(range(3, 1203), SamplingParams(prompt_logprobs=p)) for p in (1, None))
    for seq in (wants, plain):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.num_tokens == [PROMPT_LOGPROBS_CHUNK, 1200]


def test_prompt_logprobs_and_n_cross_the_engine_process(tiny):
    folder, ref = tiny
    engine = AsyncLLMEngine(EngineClient(functools.partial(LLMEngine, str(folder), progress=False, block_size=4)))

    async def run():
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=3, n=2, prompt_logprobs=K)
        return [o async for o in engine.generate("r", PROMPT, params)]

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
        engine.engine.close()
    assert outs[-1].finished and [len(c.token_ids) for c in outs[-1].outputs] == [3, 3]  # n = 2 over the pipe
    for out in outs:
        check_prompt_logprobs(out.prompt_logprobs, ref, K)


# -- the server: echo on the tiny model (token ids; 1e-4) -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server(tiny):
    folder, ref = tiny
    engine = AsyncLLMEngine(LLMEngine(str(folder), progress=False, block_size=4))
    with ServerThread(build_app(engine)) as s:
        yield s, ref
    engine.shutdown()


def check_echo_logprobs(lp: dict, ref: torch.Tensor, generated: int) -> None:
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(PROMPT) + generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(PROMPT)):
        assert abs(lp["token_logprobs"][j] - ref[j - 1, PROMPT[j]].item()) <= 1e-4
        torch.testing.assert_close(torch.tensor(sorted(lp["top_logprobs"][j].values(), reverse=True)),
                                   ref[j - 1].topk(len(lp["top_logprobs"][j])).values, atol=1e-4, rtol=0)
    for j in range(len(PROMPT), len(PROMPT) + generated):  # the completion's own, after the prompt's
        assert lp["token_logprobs"][j] <= 0 and lp["top_logprobs"][j]


@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_echo_logprobs_through_the_server(tiny_server, max_tokens):
    server, ref = tiny_server
    body = {"prompt": [PROMPT], "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    check_echo_logprobs(choice["logprobs"], ref, max_tokens)
    assert r.json()["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": max_tokens,
                                 "total_tokens": len(PROMPT) + max_tokens}
    # Streamed: the first chunk is the prompt with its log-probabilities, then the completion's chunks.
    events = [json.loads(line[6:]) for line in httpx.post(server.url + "/v1/completions", json={
        **body, "stream": True}).text.splitlines() if line.startswith("data: {")]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"] == choice["logprobs"]["token_logprobs"][:len(PROMPT)]
    streamed = [t for e in events[1:] for c in e["choices"] if c["logprobs"]
                for t in c["logprobs"]["token_logprobs"]]
    assert streamed == choice["logprobs"]["token_logprobs"][len(PROMPT):]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_with_n_gives_every_choice_the_prompt(tiny_server):
    server, ref = tiny_server
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 1, "n": 3,
                                                          "max_tokens": 2, "temperature": 1.0, "seed": 9})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for c in choices:
        check_echo_logprobs(c["logprobs"], ref, 2)


def test_max_tokens_zero_needs_echo(tiny_server):
    server, _ = tiny_server
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]


# -- the offline eval: lm-evaluation-harness's local-completions requests, on the default model ------------------
@pytest.fixture(scope="module")
def server(smollm_path):  # noqa: F811
    engine = AsyncLLMEngine(LLMEngine(str(smollm_path), progress=False, max_model_len=256))
    with ServerThread(build_app(engine)) as s:
        yield s, engine.engine.tokenizer
    engine.shutdown()


# (context, continuation): lm-eval's loglikelihood requests for a small multiple-choice task.
LOGLIKELIHOOD = [("The capital of France is", " Paris"), ("The capital of France is", " Berlin"),
                 ("Water freezes at zero degrees", " Celsius"), ("One, two, three,", " four")]


def lm_eval_loglikelihood(url: str, tok, context: str, continuation: str, max_tokens: int) -> tuple[float, bool, int]:
    """One request as local-completions sends it (tokenized, batch size 1), read as its parse_logprobs reads it."""
    context_enc, continuation_enc = tok.encode(context), tok.encode(continuation, add_special_tokens=False)
    payload = {"model": "smollm", "prompt": [context_enc + continuation_enc], "temperature": 0,
               "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": True}
    out = httpx.post(url + "/v1/completions", json=payload, timeout=120).json()
    ctxlen = len(context_enc)
    (choice,) = sorted(out["choices"], key=itemgetter("index"))
    cut = slice(ctxlen, -1) if max_tokens else slice(ctxlen, None)  # lm-eval drops the generated token
    values, tops = choice["logprobs"]["token_logprobs"][cut], choice["logprobs"]["top_logprobs"][cut]
    greedy = all(value == max(top.values()) for value, top in zip(values, tops))
    return sum(values), greedy, len(values)


def reference_loglikelihood(hf, tok, context: str, continuation: str) -> tuple[float, bool]:
    ids, cont = tok.encode(context), tok.encode(continuation, add_special_tokens=False)
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([ids + cont])).logits[0].float(), dim=-1)
    rows = lp[len(ids) - 1: len(ids) + len(cont) - 1]
    picked = rows.gather(1, torch.tensor(cont).unsqueeze(1))[:, 0]
    return picked.sum().item(), bool((rows.argmax(dim=-1) == torch.tensor(cont)).all())


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_requests_match_transformers(server, hf_smollm, max_tokens):
    s, tok = server
    for context, continuation in LOGLIKELIHOOD:
        got, greedy, count = lm_eval_loglikelihood(s.url, tok, context, continuation, max_tokens)
        want, want_greedy = reference_loglikelihood(hf_smollm, tok, context, continuation)
        assert count == len(tok.encode(continuation, add_special_tokens=False))
        assert abs(got - want) <= 2e-3 * count, (context, continuation, got, want)  # SmolLM2's logit agreement
        assert greedy == want_greedy, (context, continuation)
    # The task's answer: Paris over Berlin, as transformers ranks them.
    paris, berlin = (lm_eval_loglikelihood(s.url, tok, *LOGLIKELIHOOD[i], max_tokens)[0] for i in (0, 1))
    assert paris > berlin


def test_lm_eval_generate_until_matches_transformers_greedy(server, hf_smollm):
    s, tok = server
    context, until = "Q: What is the capital of France?\nA:", ["\n", "."]
    payload = {"prompt": [tok.encode(context)], "model": "smollm", "max_tokens": 24, "temperature": 0,
               "stop": until, "seed": 1234}
    out = httpx.post(s.url + "/v1/completions", json=payload, timeout=120).json()
    text = [c["text"] for c in sorted(out["choices"], key=itemgetter("index"))][0]  # lm-eval's parse_generations
    ids = tok.encode(context)
    with torch.inference_mode():
        gen = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    want = tok.decode(gen[0, len(ids):].tolist())
    for stop in until:  # lm-eval cuts at the first stop sequence; the server already has
        want = want.split(stop)[0]
    assert text == want and text.strip()


def test_echo_text_through_the_openai_client(server):
    s, _ = server
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    prompt = "The capital of France is"
    r = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text
    only = client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    lp = only.choices[0].logprobs
    assert "".join(lp.tokens) == prompt and lp.token_logprobs[0] is None and len(lp.token_logprobs) > 1
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True))
    assert streamed == r.choices[0].text
