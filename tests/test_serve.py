"""The server with real clients on loopback: OpenAI's Python client (chat and completions, streaming and not) against
the default model (SmolLM2, CPU), TGI's routes, /metrics, /health, the API key, and every error path the issue
names, checked for OpenAI's error shape, the status and the field named."""

from __future__ import annotations

import json

import httpx
import pytest

from anygpu.serve import ServerThread, build_app

from ._models_fixtures import smollm_path  # noqa: F401 - fixture
from ._serve_fixtures import client, engine, server  # noqa: F401 - fixtures

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "test-key-123"


@pytest.fixture(scope="module")
def model(server):
    """The name the server reports (the default: the model's own, tests/test_serve_names.py)."""
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- OpenAI routes with OpenAI's client -----------------------------------------------------------------------
def test_models_lists_the_served_model(client, model, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra["max_model_len"] == engine.engine.max_model_len


def test_chat_answers_and_counts_tokens(client, model, engine):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert "Paris" in r.choices[0].message.content and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"  # the model ends its answer with EOS
    prompt = engine.engine.tokenizer.encode_chat(QUESTION)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_the_plain_answer(client, model):
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    # include_usage: the last chunk has no choices and the totals; every other chunk says usage: null.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_plain_stream_and_length(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    stream = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text
    assert stream[-1].choices[0].finish_reason == "length"


def test_completions_default_is_16_tokens_and_token_id_prompts_work(client, model, engine):
    ids = engine.engine.tokenizer.encode("Once upon a time")
    r = client.completions.create(model=model, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == len(ids)
    same = client.completions.create(model=model, prompt="Once upon a time", temperature=0,
                                     extra_body={"ignore_eos": True})
    assert same.choices[0].text == r.choices[0].text


def test_stop_string_ends_the_answer_without_it(client, model):
    full = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    assert " 6" in full
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"])
    assert r.choices[0].text == full[: full.index(" 6")] and r.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client, model):
    a, b = (client.completions.create(model=model, prompt="Tell me a story", max_tokens=8, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


# -- errors -------------------------------------------------------------------------------------------------
def test_client_errors_name_the_field(client, model):
    # (Unknown model names: tests/test_serve_names.py.)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, temperature=3)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10_000)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * 300)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, n=17)  # past MAX_N
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=0)  # 0 only with echo
    assert e.value.param == "max_tokens"


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    (b'{"model": "M", "messages": []}', 400, "messages"),
    (b'{"model": "M", "messages": [{"role": "robot", "content": "hi"}]}', 400, "messages.0.role"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": "0.5"}', 400, "temperature"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}', 400, "max_tokens"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": true}', 400, "max_tokens"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}', 400, "top_p"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": -3}', 400,
     "presence_penalty"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_k": -5}', 400, "top_k"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}',
     400, "stream_options"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [999999]}', 400,
     "stop_token_ids"),
])
def test_bad_bodies_get_openai_errors(server, model, body, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", content=body.replace(b'"M"', json.dumps(model).encode()))
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param:
        assert err["message"].startswith(param)


def test_bad_completion_prompts(server, model):
    for prompt, fragment in ((["a", "b"], "batches"), ([10**9], "token ids"), ("", "non-empty")):
        r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": prompt})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt" and fragment in r.json()["error"]["message"]


def test_unknown_routes_and_methods_use_the_error_shape(server):
    assert error_of(httpx.get(server.url + "/v1/nothing"))["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"


def test_body_size_limit(engine, model):
    with ServerThread(build_app(engine, max_body_bytes=2000)) as s:
        big = {"model": model, "prompt": "x" * 5000}
        r = httpx.post(s.url + "/v1/completions", json=big)
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit is enforced while reading
            yield json.dumps(big).encode()

        r = httpx.post(s.url + "/v1/completions", content=chunks())
        assert r.status_code == 413
        ok = httpx.post(s.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200


def test_api_key(engine, model):
    with ServerThread(build_app(engine, api_key=KEY)) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.get(s.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        r = httpx.post(s.url + "/generate", json={"inputs": "Hi"})
        assert r.status_code == 401 and r.json()["error_type"] == "authentication"
        # Probes and scrapers need no key.
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
    with pytest.raises(ValueError, match="api_key"):
        build_app(engine, api_key="")


# -- TGI routes ------------------------------------------------------------------------------------------------
def test_tgi_generate_matches_completions(server, client, model):
    prompt = "The capital of France is"
    ref = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    r = httpx.post(server.url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 6,
                                                                                       "details": True}})
    assert r.status_code == 200
    body = r.json()
    assert body["generated_text"] == ref
    assert body["details"]["finish_reason"] == "length" and body["details"]["generated_tokens"] == 6
    assert "".join(t["text"] for t in body["details"]["tokens"]) == ref
    full = httpx.post(server.url + "/generate", json={"inputs": prompt, "parameters": {
        "max_new_tokens": 6, "return_full_text": True}}).json()
    assert full["generated_text"] == prompt + ref

    events = []
    with httpx.stream("POST", server.url + "/generate_stream",
                      json={"inputs": prompt, "parameters": {"max_new_tokens": 6}}) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert "".join(e["token"]["text"] for e in events) == ref
    assert events[-1]["generated_text"] == ref and events[-1]["details"]["finish_reason"] == "length"
    assert all(e["generated_text"] is None for e in events[:-1])


def test_tgi_errors_use_tgi_shape(server):
    for body in ({"inputs": ""}, {"inputs": "hi", "parameters": {"temperature": 0}},
                 {"inputs": "hi", "parameters": {"max_new_tokens": 100000}},
                 {"inputs": "hi", "parameters": {"best_of": 2}}):
        r = httpx.post(server.url + "/generate", json=body)
        assert r.status_code == 422, (body, r.text)
        assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "validation"
    info = httpx.get(server.url + "/info").json()
    assert info["max_total_tokens"] == 256


# -- health and metrics ---------------------------------------------------------------------------------------
def test_health_and_metrics(server, client, model):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client.completions.create(model=model, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    for name in ("anygpu_time_to_first_token_seconds_bucket", "anygpu_inter_token_latency_seconds_bucket",
                 "anygpu_e2e_request_latency_seconds_count", "anygpu_num_requests_running",
                 "anygpu_num_requests_waiting", "anygpu_kv_cache_usage_perc", "anygpu_prompt_tokens_total",
                 "anygpu_generation_tokens_total", 'anygpu_request_success_total{finished_reason="length"'):
        assert name in text, name
    # "name{labels} value": label values may hold spaces (the default model name does), the value never.
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    label = f'{{model_name="{model}"}}'
    assert values[f"anygpu_generation_tokens_total{label}"] >= 3
    assert values[f"anygpu_num_requests_running{label}"] == 0
