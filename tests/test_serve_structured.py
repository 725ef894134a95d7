"""Structured output through the server (issue 24): ``response_format`` JSON mode and JSON schema on
``/v1/chat/completions`` and ``/v1/completions``, and vLLM's ``guided_json``, with the real OpenAI client against
a real server on loopback, on the default model (SmolLM2), streamed and not.  The answers parse and match the
schema and end with finish_reason "stop"; bad formats and schemas are 400s naming ``response_format``."""

from __future__ import annotations

import functools
import json

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field

from anygpu.engine import AsyncLLMEngine, LLMEngine
from anygpu.engine.engine_process import EngineClient
from anygpu.serve import ServerThread, build_app

from ._models_fixtures import smollm_path  # noqa: F401 - fixture
from ._serve_fixtures import client, engine, server  # noqa: F401 - fixtures

openai = pytest.importorskip("openai")


class Capital(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


SCHEMA = Capital.model_json_schema()
FORMAT = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}}
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON with the keys city and "
                                        "country."}]


MAX_MODEL_LEN = 512  # the engine fixture's context (tests/_serve_fixtures.py)


def test_chat_json_schema_answers_the_question(client):
    r = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=60,
                                       response_format=FORMAT)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    answer = Capital.model_validate_json(choice.message.content, strict=True)
    assert answer.city == "Paris"


def test_chat_json_schema_streams_the_same_text(client):
    plain = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=60,
                                           response_format=FORMAT)
    chunks = list(client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=60,
                                                 response_format=FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_sampled_runs_all_match_the_schema(client):
    r = client.chat.completions.create(model="m", messages=QUESTION, temperature=1.0, seed=7, max_tokens=80, n=4,
                                       response_format=FORMAT)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        Capital.model_validate_json(choice.message.content, strict=True)


def test_json_object_mode_on_chat_and_completions(client):
    r = client.chat.completions.create(model="m", temperature=0, max_tokens=80,
                                       messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the grammar holds to the end: a long object is a cut-off prefix of one
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")
    c = client.completions.create(model="m", prompt="The capital of France as JSON with a key city:", temperature=0,
                                  max_tokens=40, extra_body={"response_format": FORMAT})
    assert c.choices[0].finish_reason == "stop"
    assert Capital.model_validate_json(c.choices[0].text, strict=True)


def test_vllm_guided_json_extension(client):
    c = client.completions.create(model="m", prompt="Pick a number:", temperature=1.0, seed=1, max_tokens=20,
                                  extra_body={"guided_json": {"type": "integer", "minimum": 1, "maximum": 9}})
    assert c.choices[0].finish_reason == "stop" and 1 <= json.loads(c.choices[0].text) <= 9
    chunks = list(client.completions.create(model="m", prompt="Pick a number:", temperature=1.0, seed=1,
                                            max_tokens=20, stream=True,
                                            extra_body={"guided_json": json.dumps({"enum": ["a", "b"]})}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert json.loads(text) in ("a", "b")


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "yaml"}, "response_format.type"),
    ({}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"description": "x" * 70000}}},
     "response_format.json_schema.schema"),
])
def test_bad_response_formats_are_400_naming_the_field(client, fmt, param):
    for call in (lambda: client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4,
                                                        response_format=fmt),
                 lambda: client.completions.create(model="m", prompt="Hi", max_tokens=4,
                                                   extra_body={"response_format": fmt})):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == param, info.value.body
        assert param.split(".")[-1] in info.value.body["message"] or param in info.value.body["message"]


def test_both_response_format_and_guided_json_is_400(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "response_format": {"type": "json_object"},
                                                         "guided_json": {"type": "object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "guided_json": {"type": "bad"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"


def test_server_serves_on_after_bad_schemas(client):
    r = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, temperature=0)
    assert r.choices[0].message.content


def test_engine_in_its_own_process(smollm_path):  # noqa: F811 - anygpu serve's default: params cross a pipe
    engine = AsyncLLMEngine(EngineClient(functools.partial(LLMEngine, str(smollm_path), progress=False,
                                                           max_model_len=512)))
    try:
        with ServerThread(build_app(engine)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            r = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=60,
                                               response_format=FORMAT)
            assert Capital.model_validate_json(r.choices[0].message.content, strict=True).city == "Paris"
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model="m", messages=QUESTION, response_format={
                    "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bad"}}})
    finally:
        engine.shutdown()
        engine.engine.close()  # the engine's process


def test_tgi_grammar_json(server):
    hub = pytest.importorskip("huggingface_hub")
    text = hub.InferenceClient(base_url=server.url).text_generation(
        "The capital of France as JSON with the keys city and country:", max_new_tokens=40,
        grammar={"type": "json", "value": SCHEMA})
    assert Capital.model_validate_json(text, strict=True).city == "Paris"
    for grammar, param in (({"type": "regex", "value": "a+"}, "parameters.grammar"),
                           ({"type": "json", "value": {"type": "bad"}}, "parameters.grammar.value")):
        r = httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {"grammar": grammar}})
        assert r.status_code == 422 and param in r.json()["error"], r.text
