"""The model-name policy (issue 24, ``serve/names.py``): the default name is the model's own (the GGUF's
``general.name``, read here with the ``gguf`` package as the oracle; an HF cache folder's repo id), a request
without ``model`` or with an unknown one runs on the one model served unless ``strict_model_name`` asks for
OpenAI's 404, ``model_name`` takes several aliases.  Real OpenAI client, real server on loopback."""

from __future__ import annotations

import types

import httpx
import pytest
from click.testing import CliRunner

from anygpu.cli import cli
from anygpu.engine import AsyncLLMEngine, LLMEngine
from anygpu.serve import ServerThread, build_app
from anygpu.serve.names import default_model_name, parse_names

from ._models_fixtures import smollm_path  # noqa: F401 - fixture

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(smollm_path):  # noqa: F811
    eng = AsyncLLMEngine(LLMEngine(str(smollm_path), progress=False, max_model_len=256))
    yield eng
    eng.shutdown()


def served(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]


def test_default_name_is_the_gguf_general_name(engine, smollm_path):  # noqa: F811
    from gguf import GGUFReader

    name = GGUFReader(smollm_path, "r").fields["general.name"].contents()
    assert name and name != smollm_path.name
    with ServerThread(build_app(engine)) as s:
        assert served(s.url) == [name]
        assert httpx.get(s.url + "/info").json()["model_id"] == name


def test_default_name_of_folders(tmp_path):
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert default_model_name(types.SimpleNamespace(model_path=snapshot, model_name="x")) == "HuggingFaceTB/SmolLM2-135M"
    plain = tmp_path / "my-model"
    plain.mkdir()
    assert default_model_name(types.SimpleNamespace(model_path=plain, model_name="x")) == "my-model"
    assert default_model_name(types.SimpleNamespace(model_path=None, model_name="tiny")) == "tiny"


def test_missing_or_unknown_name_means_the_served_model(engine):
    with ServerThread(build_app(engine)) as s:
        name = served(s.url)[0]
        # As TGI's and llama.cpp's curl examples: no "model" at all.
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 8, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        assert r.json()["model"] == name
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        for other in ("gpt-4", "tgi", "dummy"):
            answer = client.chat.completions.create(model=other, messages=QUESTION, max_tokens=8, temperature=0)
            assert answer.choices[0].message.content == r.json()["choices"][0]["message"]["content"]
            assert answer.model == name
        done = client.completions.create(model="anything", prompt="1, 2, 3,", max_tokens=2, temperature=0)
        assert done.usage.completion_tokens == 2


def test_strict_names_and_aliases(engine):
    with ServerThread(build_app(engine, model_name=["smol, smollm2", "small"], strict_model_name=True)) as s:
        assert served(s.url) == ["smol", "smollm2", "small"]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=2)
        assert e.value.param == "model" and e.value.code == "model_not_found" and "'smollm2'" in e.value.message
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="tgi", prompt="hi", max_tokens=2)
        # An alias answers under its own name; a missing name is still the one model.
        assert client.completions.create(model="small", prompt="hi", max_tokens=2).model == "small"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "smol"
        assert httpx.get(s.url + "/metrics").text.count('model_name="smol"') > 0


@pytest.mark.parametrize("bad", ["", "a,,b", [" "], ["a", 3]])
def test_bad_names_are_refused(engine, bad):
    with pytest.raises(ValueError, match="model_name"):
        build_app(engine, model_name=bad)
    with pytest.raises(ValueError, match="strict_model_name"):
        build_app(engine, strict_model_name="yes")


def test_parse_names_splits_and_dedups():
    assert parse_names(["a,b", "c", "a"]) == ["a", "b", "c"]
    assert parse_names("m") == ["m"]


def test_cli_refuses_empty_names_before_loading():
    r = CliRunner().invoke(cli, ["serve", "--served-model-name", "a,", "--port", "0"])
    assert r.exit_code == 2 and "--served-model-name" in r.output
