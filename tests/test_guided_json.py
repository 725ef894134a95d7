"""Structured output (issue 24), the engine's side: ``SamplingParams.guided_json`` constrains the tokens to JSON that
matches the schema, through llguidance's real token masks (no mock).  A tiny random model with SmolLM2's
tokenizer is the adversary (at temperature 1 it would write anything): every one of 50 sampled runs parses and
validates against the schema (pydantic is the oracle), and ends with finish_reason "stop" when the grammar is
complete.  Bad schemas are refused when the params are made; a grammar that fails mid-request fails that request
alone; unguided requests never build a grammar."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from anygpu import LLM
from anygpu.engine import LLMEngine, SamplingParams
from anygpu.engine.guided import MAX_SCHEMA_CHARS, check_guided_json

from ._models_fixtures import smollm, smollm_path  # noqa: F401 - fixtures


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: Literal["red", "green", "blue"]
    ok: bool


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=0, le=999)
    name: str = Field(max_length=12)
    score: float | None = None
    items: list[Item] = Field(max_length=3)


SCHEMA = Record.model_json_schema()  # $defs and $ref, anyOf with null, enums, bounds: what apps send


@pytest.fixture(scope="module")
def tiny(smollm):  # noqa: F811
    """Random weights, SmolLM2's tokenizer: a real vocabulary of 49,152 byte-level BPE tokens."""
    cfg = dataclasses.replace(smollm.config, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                              num_kv_heads=1, head_dim=32, max_position=1024)
    engine = LLMEngine(config=cfg, tokenizer=smollm.tokenizer, progress=False, num_kv_blocks=1024, max_num_seqs=64)
    yield engine
    engine.close()


def run(engine, prompts_params):
    for i, (prompt, params) in enumerate(prompts_params):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts_params))]


def test_fifty_sampled_runs_parse_and_match_the_schema(tiny):
    runs = [("Write a record:", SamplingParams(max_tokens=300, temperature=1.0, seed=seed, guided_json=SCHEMA))
            for seed in range(50)]
    outs = run(tiny, runs)
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text, out.error)
        Record.model_validate_json(out.text, strict=True)
    assert len({out.text for out in outs}) > 40  # sampled, not one fixed answer
    assert not tiny.requests


@pytest.mark.parametrize("schema", [
    {"type": "object"},  # JSON mode
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"enum": ["yes", "no", 3, None]},
    {"type": "object", "properties": {"when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}},
     "required": ["when"], "additionalProperties": False},
])
def test_other_shapes_greedy_and_sampled(tiny, schema):
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, guided_json=schema) for t, s in
              ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3))]
    for out in run(tiny, [("Hi", p) for p in params]):
        if out.finish_reason == "length":  # JSON mode lets a random model write a long object: it stays a prefix
            assert schema == {"type": "object"} and out.text.startswith("{")
            continue
        assert out.finish_reason == "stop", (out.text, out.error)
        value = json.loads(out.text)
        if schema.get("type") == "object":
            assert isinstance(value, dict)
        if "pattern" in json.dumps(schema):
            assert set(value) == {"when"} and len(value["when"]) == 7 and value["when"][4] == "-"
        if schema.get("type") == "array":
            assert 1 <= len(value) <= 4 and all(isinstance(v, int) and -5 <= v <= 5 for v in value)
        if "enum" in schema:
            assert value in schema["enum"]


def test_unguided_requests_in_the_same_batch_are_untouched(tiny):
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = run(tiny, [("Hello there", free)])[0]
    mixed = run(tiny, [("Hello there", free), ("Hi", SamplingParams(max_tokens=50, guided_json=SCHEMA, seed=0))])
    assert mixed[0].token_ids == alone.token_ids
    assert tiny._guides._ll_tokenizer is not None  # built by the guided request, once


@pytest.mark.parametrize("bad, words", [
    ({"type": "no-such-type"}, "no-such-type"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ("{not json", "not valid JSON"),
    ([1, 2], "expected a JSON schema"),
    ({"description": "x" * MAX_SCHEMA_CHARS}, "at most"),
    ({"enum": [float("nan")]}, "guided_json"),
])
def test_bad_schemas_are_refused_naming_the_field(bad, words):
    with pytest.raises(ValueError, match="^guided_json: ") as info:
        SamplingParams(guided_json=bad)
    assert words in str(info.value)


def test_schema_as_json_text_and_deep_nesting():
    assert check_guided_json(json.dumps(SCHEMA)) == SCHEMA
    deep = {}
    for _ in range(5000):  # within the size bound, far past any sane depth: refused, no crash
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match="^guided_json: "):
        SamplingParams(guided_json=deep)


def test_a_failing_grammar_fails_its_request_alone(tiny):
    guided = SamplingParams(max_tokens=40, temperature=1.0, seed=3, guided_json=SCHEMA)
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tiny.add_request("bad", "Hi", guided)
    tiny.add_request("good", "Hello", free)
    tiny.requests["bad"].seq.guide._matcher.consume_token(0)  # token 0 is never valid JSON: the matcher errs
    done = {}
    while tiny.has_unfinished():
        done.update({o.request_id: o for o in tiny.step() if o.finished})
    assert done["bad"].finish_reason == "error" and "guided_json" in done["bad"].error
    assert done["good"].finish_reason == "length" and len(done["good"].token_ids) == 8


def test_offline_llm_on_the_default_model(smollm_path):  # noqa: F811
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    llm = LLM(str(smollm_path), progress=False, max_model_len=512)
    try:
        out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON with the keys "
                                                    "city and country."}],
                       SamplingParams(max_tokens=60, temperature=0, guided_json=schema))[0]
    finally:
        llm.close()
    assert out.outputs[0].finish_reason == "stop"
    value = json.loads(out.outputs[0].text)
    assert value["city"] == "Paris", value
