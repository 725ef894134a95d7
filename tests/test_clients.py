"""TGI's own clients against ``anygpu serve`` on loopback (issue 24): ``text_generation.Client`` and
``huggingface_hub.InferenceClient``, streaming and not, with their error types, over the default model (SmolLM2,
CPU).  The answers are compared with what ``/generate`` gives for the same request, so a client that reads a
field wrong, or a route that answers in another shape, fails here."""

from __future__ import annotations

import httpx
import pytest

from anygpu.serve import ServerThread, build_app

from ._models_fixtures import smollm_path  # noqa: F401 - fixture
from ._serve_fixtures import engine, server  # noqa: F401 - fixtures

# Plain imports: the test extras install both (text-generation through the Makefile), so a missing client is a
# failure, not a skip.
import huggingface_hub  # noqa: E402
import text_generation  # noqa: E402

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "clients-key-1"


@pytest.fixture(scope="module")
def reference(server):
    """``/generate``'s greedy answer to PROMPT, 6 tokens, with details: what every client must reproduce."""
    r = httpx.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6,
                                                                                    "details": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def tgi(server):
    return text_generation.Client(server.url, timeout=60)


@pytest.fixture(scope="module")
def hf(server):
    return huggingface_hub.InferenceClient(base_url=server.url, timeout=60)


# -- text_generation.Client --------------------------------------------------------------------------------
def test_text_generation_generate(tgi, reference):
    r = tgi.generate(PROMPT, max_new_tokens=6)
    assert r.generated_text == reference["generated_text"] and "Paris" in r.generated_text
    assert r.details.finish_reason == text_generation.types.FinishReason.Length
    assert r.details.generated_tokens == 6
    assert [t.id for t in r.details.tokens] == [t["id"] for t in reference["details"]["tokens"]]
    assert "".join(t.text for t in r.details.tokens) == r.generated_text


def test_text_generation_stream(tgi, reference):
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=6))
    assert len(events) == 6
    assert "".join(e.token.text for e in events) == reference["generated_text"]
    assert [e.token.id for e in events] == [t["id"] for t in reference["details"]["tokens"]]
    assert events[-1].generated_text == reference["generated_text"]
    assert events[-1].details.finish_reason == text_generation.types.FinishReason.Length
    assert all(e.generated_text is None and e.details is None for e in events[:-1])


def test_text_generation_stop_sequence_and_full_text(tgi):
    r = tgi.generate("1, 2, 3, 4,", max_new_tokens=12, stop_sequences=[" 6"], return_full_text=True)
    assert r.generated_text.startswith("1, 2, 3, 4,") and not r.generated_text.endswith(" 6")
    assert r.details.finish_reason == text_generation.types.FinishReason.StopSequence


def test_text_generation_errors_are_its_own_types(tgi):
    with pytest.raises(text_generation.errors.ValidationError, match="max_new_tokens"):
        tgi.generate(PROMPT, max_new_tokens=100_000)
    with pytest.raises(text_generation.errors.ValidationError, match="max_new_tokens"):
        list(tgi.generate_stream(PROMPT, max_new_tokens=100_000))
    with pytest.raises(text_generation.errors.ValidationError, match="top_n_tokens"):
        tgi.generate(PROMPT, max_new_tokens=2, top_n_tokens=3)  # refused, not silently dropped


def test_text_generation_seeded_sampling_repeats(tgi):
    a, b = (tgi.generate(PROMPT, max_new_tokens=8, do_sample=True, seed=11, temperature=1.0) for _ in range(2))
    assert a.generated_text == b.generated_text and a.details.seed == 11


# -- huggingface_hub.InferenceClient -----------------------------------------------------------------------
def test_hub_text_generation(hf, reference):
    assert hf.text_generation(PROMPT, max_new_tokens=6) == reference["generated_text"]
    out = hf.text_generation(PROMPT, max_new_tokens=6, details=True)
    assert out.generated_text == reference["generated_text"]
    assert out.details.finish_reason == "length" and out.details.generated_tokens == 6


def test_hub_text_generation_stream(hf, reference):
    pieces = list(hf.text_generation(PROMPT, max_new_tokens=6, stream=True))
    assert "".join(pieces) == reference["generated_text"]
    events = list(hf.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    assert [e.token.id for e in events] == [t["id"] for t in reference["details"]["tokens"]]
    assert events[-1].details.finish_reason == "length"


def test_hub_text_generation_errors(hf):
    with pytest.raises(huggingface_hub.errors.ValidationError, match="max_new_tokens"):
        hf.text_generation(PROMPT, max_new_tokens=100_000)
    with pytest.raises(huggingface_hub.errors.ValidationError, match="max_new_tokens"):
        list(hf.text_generation(PROMPT, max_new_tokens=100_000, stream=True))


def test_hub_chat_completion_sends_its_placeholder_model_name(hf, server):
    # The client sends model="dummy" when pointed at a URL: with one model served, that means the model.
    r = hf.chat_completion(QUESTION, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    plain = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": QUESTION, "max_tokens": 16, "temperature": 0}, timeout=60).json()
    assert r.choices[0].message.content == plain["choices"][0]["message"]["content"]
    assert r.model == plain["model"] == server_model(server)
    chunks = list(hf.chat_completion(QUESTION, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_hub_chat_completion_error_is_an_http_error(hf):
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as e:
        hf.chat_completion(QUESTION, max_tokens=100_000)
    assert e.value.response.status_code == 400 and "max_tokens" in str(e.value)


def test_hub_health_and_endpoint_info(server):
    client = huggingface_hub.InferenceClient(server.url, provider="hf-inference")
    assert client.health_check()
    info = client.get_endpoint_info()
    assert info["model_id"] == server_model(server)
    assert info["max_total_tokens"] == 256 and info["max_input_length"] == info["max_input_tokens"] == 255


def test_clients_send_the_api_key(engine):
    with ServerThread(build_app(engine, api_key=KEY)) as s:
        assert text_generation.Client(s.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).generate(
            PROMPT, max_new_tokens=2).details.generated_tokens == 2
        assert huggingface_hub.InferenceClient(base_url=s.url, api_key=KEY, timeout=60).text_generation(
            PROMPT, max_new_tokens=2)
        # TGI's error_type "authentication" is not one the clients map: they raise their UnknownError.
        with pytest.raises(huggingface_hub.errors.UnknownError, match="API key") as e:
            huggingface_hub.InferenceClient(base_url=s.url, api_key="wrong", timeout=60).text_generation(PROMPT)
        assert e.value.__cause__.response.status_code == 401
        with pytest.raises(text_generation.errors.UnknownError, match="API key"):
            text_generation.Client(s.url, timeout=60).generate(PROMPT, max_new_tokens=2)


def server_model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
