"""Every numeric request field is bounded before use (issue 21): through a real server on loopback (a tiny random
model, vocabulary 1024), each out-of-range value is a 400 (OpenAI routes) or 422 (TGI routes) naming the field,
the schema shows the bounds, and the engine keeps serving.  The exact cases of the issue: ``seed`` 2**64 and
``top_k`` 2**63 used to kill the engine; 400,000 stop strings used to slow every other request."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from anygpu.bench.model import random_engine
from anygpu.engine import AsyncLLMEngine, SamplingParams
from anygpu.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from anygpu.serve import ServerThread, build_app

BIG_SEED = 18446744073709551616  # 2**64: the issue's request


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine(random_engine("tiny", max_num_seqs=8, progress=False))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with ServerThread(build_app(engine)) as s:
        yield s.url


def post(url: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "w1 w2", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def tgi(**parameters) -> dict:
    return {"inputs": "w1 w2", "parameters": {"max_new_tokens": 2, **parameters}}


def assert_alive(url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    r = post(url, "/v1/completions", completion(temperature=1, seed=3))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_the_issues_seed_and_top_k_requests_are_400_and_the_engine_lives(url):
    r = post(url, "/v1/completions", completion(prompt="Hi", temperature=1, seed=BIG_SEED))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    r = post(url, "/generate", tgi(do_sample=True, seed=BIG_SEED))
    assert r.status_code == 422 and r.json()["error"].startswith("parameters.seed"), r.text
    r = post(url, "/v1/completions", completion(temperature=1, top_k=2**63, top_p=0.5))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    r = post(url, "/generate", tgi(do_sample=True, top_k=2**63, top_p=0.5))
    assert r.status_code == 422 and r.json()["error"].startswith("parameters.top_k"), r.text
    assert_alive(url)


def test_64_bit_seeds_work_at_both_ends(url):
    texts = {}
    for seed in (2**64 - 1, -1, -(2**63), 0):
        r = post(url, "/v1/completions", completion(temperature=1, seed=seed, max_tokens=6, ignore_eos=True))
        assert r.status_code == 200, r.text
        texts[seed] = r.json()["choices"][0]["text"]
    assert texts[2**64 - 1] == texts[-1]  # a negative seed is its two's complement, as torch reads it
    r = post(url, "/generate", tgi(do_sample=True, seed=2**64 - 1, details=True))
    assert r.status_code == 200 and r.json()["details"]["seed"] == 2**64 - 1
    r = post(url, "/generate", tgi(do_sample=True, seed=-1))
    assert r.status_code == 422  # TGI's seed is a u64


def test_top_k_is_bounded_by_the_vocabulary(url):
    r = post(url, "/v1/completions", completion(temperature=1, top_k=1025))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    assert "vocabulary size 1024" in r.json()["error"]["message"]
    r = post(url, "/generate", tgi(top_k=1025))
    assert r.status_code == 422 and r.json()["error"].startswith("top_k") and "1024" in r.json()["error"]
    assert post(url, "/v1/completions", completion(temperature=1, top_k=1024)).status_code == 200


OPENAI_BAD = [
    ("temperature", 2.5), ("temperature", -0.5), ("top_p", 0), ("top_p", 1.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5), ("min_p", 1.5), ("repetition_penalty", 0), ("top_k", -2),
    ("max_tokens", 0), ("max_tokens", 2**31), ("n", 0), ("n", 2**31), ("seed", -(2**63) - 1),
    ("logit_bias", {"5": 101}), ("stop_token_ids", [-1]), ("stop_token_ids", [2**31]),
]


@pytest.mark.parametrize("field, value", OPENAI_BAD, ids=[f"{f}={v}" for f, v in OPENAI_BAD])
def test_openai_fields_out_of_range_are_400_naming_them(url, field, value):
    for path, body in (("/v1/completions", completion(**{field: value})), ("/v1/chat/completions",
                                                                          chat(**{field: value}))):
        r = post(url, path, body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"].split(".")[0] == field, r.text
        assert r.json()["error"]["message"].startswith(field)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion(best_of=0), "best_of"),
    ("/v1/chat/completions", chat(max_completion_tokens=0), "max_completion_tokens"),
    ("/v1/chat/completions", chat(top_logprobs=21), "top_logprobs"),
])
def test_route_specific_counts_are_bounded(url, path, body, param):
    r = post(url, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_floats_are_refused(url, literal):
    body = json.dumps(completion(temperature=0.5)).encode().replace(b"0.5", literal)
    r = post(url, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    body = json.dumps(tgi(temperature=0.5)).encode().replace(b"0.5", literal)
    r = post(url, "/generate", body)
    assert r.status_code == 422 and r.json()["error"].startswith("parameters.temperature"), r.text


TGI_BAD = [
    ("temperature", 0), ("top_k", 0), ("top_p", 1.0), ("repetition_penalty", 0), ("frequency_penalty", 3),
    ("max_new_tokens", 0), ("max_new_tokens", 2**31), ("truncate", 0), ("truncate", 2**31), ("seed", 2**64),
    ("best_of", 0), ("typical_p", 1.5), ("top_n_tokens", -1),
]


@pytest.mark.parametrize("field, value", TGI_BAD, ids=[f"{f}={v}" for f, v in TGI_BAD])
def test_tgi_fields_out_of_range_are_422_naming_them(url, field, value):
    r = post(url, "/generate", tgi(**{field: value}))
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith(f"parameters.{field}") and r.json()["error_type"] == "validation", r.text


def test_the_schema_shows_the_bounds(url):
    schemas = httpx.get(url + "/openapi.json", timeout=10).json()["components"]["schemas"]

    def field(model, name):
        spec = schemas[model]["properties"][name]
        return next((s for s in spec.get("anyOf", [spec]) if s.get("type") != "null"), spec)

    assert field("CompletionRequest", "seed")["maximum"] == 2**64 - 1
    assert field("CompletionRequest", "seed")["minimum"] == -(2**63)
    assert field("TGIParameters", "seed") == {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}
    assert field("CompletionRequest", "top_k")["maximum"] == 2**31 - 1
    assert field("TGIParameters", "stop")["maxItems"] == MAX_STOP_STRINGS
    assert field("TGIParameters", "stop")["items"]["maxLength"] == MAX_STOP_STRING_CHARS
    assert field("ChatCompletionRequest", "stop_token_ids")["maxItems"] == MAX_STOP_TOKEN_IDS
    stop = field("CompletionRequest", "stop")["oneOf"]
    assert {s["type"] for s in stop} == {"string", "array"}


# -- stop strings (issue item 12) ---------------------------------------------------------------------------
def test_stop_string_limits_are_enforced_with_the_field_named(url):
    r = post(url, "/v1/completions", completion(stop=["w"] * (MAX_STOP_STRINGS + 1)))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop"), r.text
    assert f"at most {MAX_STOP_STRINGS}" in r.json()["error"]["message"]
    r = post(url, "/v1/chat/completions", chat(stop="x" * (MAX_STOP_STRING_CHARS + 1)))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop"), r.text
    r = post(url, "/v1/completions", completion(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    r = post(url, "/generate", tgi(stop=["w"] * (MAX_STOP_STRINGS + 1)))
    assert r.status_code == 422 and r.json()["error"].startswith("parameters.stop"), r.text
    ok = post(url, "/v1/completions", completion(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS))
    assert ok.status_code == 200, ok.text


def test_400000_stop_strings_are_refused_at_once(url):
    """The issue's request: refused before the engine sees it (it fits the 4 MiB body limit)."""
    body = completion(stop=["a"] * 400_000)
    start = time.monotonic()
    r = post(url, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop"), r.text[:300]
    assert len(r.text) < 2000  # the error does not echo the request back
    assert time.monotonic() - start < 30
    assert_alive(url)


def test_sampling_params_enforce_the_same_limits():
    for kwargs, field in (({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"top_k": 2**31}, "top_k"),
                          ({"stop": ["a"] * 400_000}, "stop"), ({"stop": ["a" * 257]}, "stop"),
                          ({"stop_token_ids": list(range(257))}, "stop_token_ids")):
        with pytest.raises(ValueError, match=rf"^{field}: expected") as e:
            SamplingParams(**kwargs)
        assert len(str(e.value)) < 400
    with pytest.raises(ValueError, match=r"^top_k: expected at most the vocabulary size 100"):
        SamplingParams(top_k=101).validate(vocab_size=100)
    SamplingParams(top_k=100, seed=2**64 - 1).validate(vocab_size=100)


def test_stop_strings_found_across_tokens_with_the_tail_search():
    """The search only looks at the new text and the ``len(longest stop) - 1`` characters before it; a stop
    string that spans tokens is still found, at its first occurrence, after a long text."""
    llm = random_engine("tiny", max_num_seqs=2, progress=False)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    llm.add_request("free", [100, 200, 300], params)
    full = None
    while llm.has_unfinished():
        for out in llm.step():
            full = out.text
    words = full.split(" ")
    stop = " ".join(words[60:62])  # spans two tokens, far into the text
    llm.add_request("stopped", [100, 200, 300], params.clone(stop=["never there", stop]))
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert outs[-1].text == full[: full.index(stop)] == "".join(o.delta_text for o in outs)


# -- the CLI ----------------------------------------------------------------------------------------------
def test_generate_cli_names_the_seed_instead_of_a_traceback():
    """Checked before the model loads: a bad value costs no load, and says which option was wrong."""
    for option, value, field in (("--seed", BIG_SEED, "seed"), ("--top-k", 2**63, "top_k")):
        run = subprocess.run([sys.executable, "-m", "anygpu.cli", "generate", "hi", "--temperature", "1", option,
                              str(value)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 2, run.stderr[-2000:]
        assert field in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
