"""Token log-probabilities (issue 24): the engine's (``SamplingParams.logprobs``) equal transformers'
log-softmax of its logits at the same positions, fp32 on the CPU, within 1e-4 on a tiny random Llama (whose
logits agree with transformers' to ~1e-4) and within SmolLM2's own logit agreement (2e-3,
tests/test_models_llama.py) on the default model; the server returns them in OpenAI's chat and completions
shapes, streamed and not, through the real OpenAI client."""

from __future__ import annotations

import pytest
import torch

from anygpu import LLM
from anygpu.engine import AsyncLLMEngine, LLMEngine, SamplingParams
from anygpu.serve import ServerThread, build_app

from ._models_fixtures import hf_smollm, smollm_path  # noqa: F401 - fixtures

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

K = 5
PROMPT = [5, 17, 300, 42, 7, 99, 512, 3]


def reference(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each generated position: row i is the distribution of generated[i]."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1: len(prompt) - 1 + len(generated)]


def check(completion, ref: torch.Tensor, atol: float) -> None:
    assert len(completion.logprobs) == len(completion.token_ids) == ref.shape[0]
    for i, (tid, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert next(iter(entry)) == tid  # the sampled token first, as vLLM
        assert abs(entry[tid].logprob - ref[i, tid].item()) <= atol, (i, entry[tid].logprob, ref[i, tid].item())
        assert entry[tid].rank == int((ref[i] > ref[i, tid]).sum()) + 1 or entry[tid].rank <= K
        top = sorted((lp for lp in entry.values() if lp.rank <= K), key=lambda lp: lp.rank)
        ref_top = ref[i].topk(K)
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in top]), ref_top.values, atol=atol, rtol=0)
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                              zip(completion.token_ids, completion.logprobs)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=64, num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=False,
                                   max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama-logprobs")
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=K),
    # Sampled, with penalties and filters: the log-probabilities are still the model's own (vLLM's default).
    SamplingParams(max_tokens=12, temperature=1.3, top_k=50, repetition_penalty=1.3, seed=3, ignore_eos=True,
                   logprobs=K),
], ids=["greedy", "sampled"])
def test_engine_logprobs_equal_transformers_tiny(tiny, params):
    folder, hf = tiny
    out = LLM(str(folder), progress=False, block_size=4).generate(PROMPT, params)[0].outputs[0]
    check(out, reference(hf, PROMPT, out.token_ids), atol=1e-4)


def test_logprobs_are_none_unless_asked_and_zero_means_the_token_only(tiny):
    folder, _ = tiny
    llm = LLM(str(folder), progress=False, block_size=4)
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    only = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=0))[0].outputs[0]
    assert [list(e) for e in only.logprobs] == [[t] for t in only.token_ids]
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


# -- the server, on the default model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm_path):  # noqa: F811
    engine = AsyncLLMEngine(LLMEngine(str(smollm_path), progress=False, max_model_len=256))
    with ServerThread(build_app(engine)) as s:
        yield s, engine.engine.tokenizer
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def test_completions_logprobs(client, server, hf_smollm):
    _, tok = server
    prompt = "The capital of France is"
    r = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=K,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ids = tok.encode(prompt)
    with torch.inference_mode():  # transformers' greedy tokens (the engine's equal them: test_models_llama.py)
        out = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    generated = out[0, len(ids):].tolist()
    assert tok.decode(generated) == r.choices[0].text == "".join(lp.tokens)
    ref = reference(hf_smollm, ids, generated)
    for i, value in enumerate(lp.token_logprobs):
        assert abs(value - ref[i, generated[i]].item()) <= 2e-3
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        torch.testing.assert_close(torch.tensor(top), ref[i].topk(K).values, atol=2e-3, rtol=0)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    stream = list(client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=K,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in stream if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    # A repeat hits the prefix cache: the prompt's last block is computed in another shape (fp32 rounding).
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs(client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="m", messages=question, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    # One entry per generated token, the EOS that ended the answer included (as vLLM: it is a sampled token).
    assert len(content) == r.usage.completion_tokens and r.choices[0].finish_reason == "stop"
    assert "".join(c.token for c in content) == r.choices[0].message.content + "<|im_end|>"
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    chunks = list(client.chat.completions.create(model="m", messages=question, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-4)  # prefix-cached repeat
    plain = client.chat.completions.create(model="m", messages=question, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logprob_errors_name_the_field(client):
    question = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=question, top_logprobs=2)
    assert e.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=question, logprobs=True, top_logprobs=21)
    assert e.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="hi", logprobs=21)
    assert e.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:  # echo with prompt logprobs: tests/test_echo_logprobs.py
        client.completions.create(model="m", prompt="hi", echo=True, logprobs=1, best_of=2)
    assert e.value.param == "best_of"
