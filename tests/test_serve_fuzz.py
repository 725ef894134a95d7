"""Property-based fuzzing of the HTTP API from its own OpenAPI description (issue 21): schemathesis generates
requests for every operation in ``/openapi.json``, valid ones (positive) and ones that break the schema
(negative), sends them to a real server on loopback over the tiny random-weights engine, and checks that no
answer is a 5xx, that every status, content type and JSON body is one the description declares, that
schema-breaking requests are refused with a 4xx, and that the engine is still alive after each request.

Deterministic (``derandomize``): CI runs the same requests every time, so a failure here is a regression and
reproduces.  ``ANYGPU_FUZZ_EXAMPLES`` scales the examples per operation and mode (default 120: about 700
requests in all); a failure prints the request as a curl command.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

from anygpu.bench.model import random_engine
from anygpu.engine import AsyncLLMEngine

from ._serve_fixtures import server  # noqa: F401 - fixture (over this module's engine)

EXAMPLES = int(os.environ.get("ANYGPU_FUZZ_EXAMPLES", "120"))
MAX_MODEL_LEN = 128  # bounds the tokens a generated request can ask for (more is a 4xx naming the field)
STEERED_MAX_TOKENS = 8
# The synthetic tokenizer's words are w0 ... w1023: a template of them gives the chat route real prompts.
CHAT_TEMPLATE = "{% for m in messages %}w{{ loop.index }} {% endfor %}{% if add_generation_prompt %}w7{% endif %}"
BODY_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def engine():
    llm = random_engine("tiny", max_num_seqs=8, max_model_len=MAX_MODEL_LEN, progress=False)
    llm.tokenizer.chat_template = CHAT_TEMPLATE
    eng = AsyncLLMEngine(llm)
    yield eng
    eng.shutdown()


def steer(case, n: int) -> None:
    """Three valid requests in four are nudged towards the engine: they name the served model, ask for a few
    tokens, and send token ids in the vocabulary; the fourth goes as generated (mostly a 4xx from the checks)."""
    body = case.body
    if not isinstance(body, dict) or n % 4 == 0:
        return
    if isinstance(body.get("model"), str):
        body["model"] = "tiny"
    counts = ((body, "max_tokens"), (body, "max_completion_tokens"), (body.get("parameters"), "max_new_tokens"))
    for where, key in counts:
        if isinstance(where, dict) and (not isinstance(where.get(key), int) or where[key] > STEERED_MAX_TOKENS):
            where[key] = STEERED_MAX_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        body["prompt"] = [abs(t) % 1000 for t in prompt]


def fuzz(op, mode, url: str, engine, sent: list) -> None:
    """``EXAMPLES`` requests of one mode to one operation, each checked; ``sent`` gets (path, status) for each."""
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        if mode is GenerationMode.POSITIVE:
            steer(case, len(sent))
        response = case.call(base_url=url, timeout=60)
        sent.append((op.path, response.status_code))
        case.validate_response(response, checks=checks)
        assert engine.healthy, f"the engine died after {case.as_curl_command()}"

    run()


def test_api_fuzz_from_its_openapi_schema(server, engine):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/generate",
                                             "/generate_stream", "/v1/models", "/info", "/health", "/metrics"}
    sent = []
    for op in operations:
        # Only POST routes take input that can break the schema (the GET routes have no parameters).
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        for mode in modes:
            fuzz(op, mode, server.url, engine, sent)

    statuses = [status for _, status in sent]
    served = sum(1 for path, status in sent if status == 200 and path in BODY_ROUTES)
    print(f"fuzz: {len(sent)} requests, {served} generations, statuses "
          f"{ {s: statuses.count(s) for s in sorted(set(statuses))} }")
    assert len(sent) >= 1000 or EXAMPLES < 200
    assert served >= 50  # the fuzzer reached the engine, not only the validators
    assert all(status < 500 for status in statuses)
