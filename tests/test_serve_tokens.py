"""``/tokenize`` (TGI's shape and vLLM's), ``/detokenize`` and ``/version`` on a real server over the default
model; the tokenizer oracle is transformers' tokenizer read from the same GGUF."""

from __future__ import annotations

import httpx
import pytest

from anygpu._version import __version__
from anygpu.engine import AsyncLLMEngine, LLMEngine
from anygpu.serve import ServerThread, build_app

from ._models_fixtures import hf_tokenizer, smollm_path  # noqa: F401 - fixtures

TEXT = "Hello world, café 東京!"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(smollm_path):  # noqa: F811
    eng = AsyncLLMEngine(LLMEngine(str(smollm_path), progress=False, max_model_len=256))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with ServerThread(build_app(engine)) as s:
        yield s.url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_tgi_tokenize_gives_ids_text_and_offsets(url, hf_tokenizer):  # noqa: F811
    tokens = post(url, "/tokenize", {"inputs": TEXT}).json()
    assert [t["id"] for t in tokens] == hf_tokenizer(TEXT)["input_ids"]
    assert all(t["text"] == TEXT[t["start"]:t["stop"]] for t in tokens)
    # Byte-level BPE splits a CJK character over several tokens that share its span; other text is tiled.
    latin = post(url, "/tokenize", {"inputs": "Hello world, café!"}).json()
    assert "".join(t["text"] for t in latin) == "Hello world, café!"


def test_vllm_tokenize_prompt_and_messages(url, engine, hf_tokenizer):  # noqa: F811
    r = post(url, "/tokenize", {"prompt": TEXT}).json()
    assert r["tokens"] == hf_tokenizer(TEXT)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256 and r["token_strs"] is None
    strs = post(url, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()["token_strs"]
    assert strs == hf_tokenizer.convert_ids_to_tokens(hf_tokenizer("Hello world")["input_ids"])
    chat = post(url, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert chat == engine.engine.tokenizer.encode_chat(CHAT)
    rendered = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    bare = post(url, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert len(bare) < len(chat) and chat[:len(bare)] == bare


def test_detokenize_round_trips(url, hf_tokenizer):  # noqa: F811
    ids = post(url, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    assert post(url, "/detokenize", {"tokens": ids}).json() == {"prompt": TEXT}
    assert post(url, "/detokenize", {"tokens": ids}).json()["prompt"] == hf_tokenizer.decode(ids)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_bodies_name_the_field(url, path, body, param):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_version(url):
    assert httpx.get(url + "/version").json() == {"version": __version__}
