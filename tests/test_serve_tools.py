"""Forced tool calls on ``/v1/chat/completions`` (issue 24, ``serve/tools.py``): with ``tool_choice`` naming a
function, or ``"required"``, the answer is constrained to the call's JSON and comes back in OpenAI's
``tool_calls`` shape with finish_reason "tool_calls", streamed and not; ``"auto"`` and malformed tool requests
are 400s naming the field.  The real OpenAI client against a real server on the default model (SmolLM2)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ConfigDict, Field

from anygpu.engine import AsyncLLMEngine, LLMEngine
from anygpu.serve import ServerThread, build_app

from ._models_fixtures import smollm_path  # noqa: F401 - fixture

openai = pytest.importorskip("openai")


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=40)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Search(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(max_length=60)


def tool(name, model, description):
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": model.model_json_schema()}}


WEATHER = tool("get_weather", Weather, "The current weather in a city.")
SEARCH = tool("search", Search, "Search the web.")
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(smollm_path):  # noqa: F811
    engine = AsyncLLMEngine(LLMEngine(str(smollm_path), progress=False, max_model_len=1024))
    try:
        with ServerThread(build_app(engine)) as server:
            yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    finally:
        engine.shutdown()


def test_named_function_call(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, SEARCH], tool_choice=FORCED,
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = Weather.model_validate_json(call.function.arguments, strict=True)
    assert args.city == "Paris"


def test_named_function_call_streamed(client):
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice=FORCED,
                                                 temperature=0, max_tokens=60, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    Weather.model_validate_json(calls[0].function.arguments, strict=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_required_picks_one_of_the_tools_sampled(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, SEARCH], tool_choice="required",
                                       temperature=1.0, seed=5, n=3, max_tokens=80)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        model = {"get_weather": Weather, "search": Search}[call.function.name]
        model.model_validate_json(call.function.arguments, strict=True)


def test_cut_call_is_text_with_length(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice=FORCED,
                                       temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("{")


def test_tool_choice_none_is_plain_text(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice"),
    (dict(tools=[WEATHER]), "tool_choice"),  # OpenAI's default with tools is "auto"
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bad"}}}],
          tool_choice="required"), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}], tool_choice="required"),
     "tools.0.function.name"),
    (dict(tools=[WEATHER], tool_choice=FORCED, response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[WEATHER], tool_choice=FORCED, logprobs=True), "logprobs"),
])
def test_refusals_name_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, **extra)
    assert info.value.body["param"] == param, info.value.body


def test_system_message_keeps_its_text(client):
    messages = [{"role": "system", "content": "Answer tersely."}, *ASK]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice=FORCED,
                                       temperature=0, max_tokens=60)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["city"]
