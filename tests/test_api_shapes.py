"""The Python API in the shapes people already write (issue 24): ``LLM.generate`` returns vLLM's
``RequestOutput`` (``.outputs[i].text``, ``.token_ids``, ``.finish_reason``, ``.prompt_token_ids``, ``logprobs`` None
unless asked), streamed outputs carry the same shape, and ``import anygpu`` reaches ``anygpu.optim``,
``anygpu.quant``, ``anygpu.nn``, ``anygpu.tunable`` and ``anygpu.ops`` lazily, as ``bnb.optim.X`` does after
``import bitsandbytes as bnb``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from anygpu.engine import SamplingParams
from anygpu.engine.llm_engine import CompletionOutput, RequestOutput

from ._models_fixtures import smollm_path  # noqa: F401 - fixture

LAZY = ("nn", "ops", "optim", "quant", "tunable")


@pytest.fixture(scope="module")
def llm(smollm_path):  # noqa: F811
    from anygpu import LLM

    return LLM(str(smollm_path), progress=False, max_model_len=256)


def test_generate_returns_vllm_shaped_outputs(llm):
    prompt = "The capital of France is"
    outs = llm.generate([prompt, "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=6))
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    out = outs[0]
    assert out.prompt == prompt and out.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert out.finished and out.prompt_logprobs is None and len(out.outputs) == 1
    done = out.outputs[0]
    assert isinstance(done, CompletionOutput) and done.index == 0
    assert "Paris" in done.text and len(done.token_ids) == 6 and done.finish_reason == "length"
    assert done.text == llm.tokenizer.decode(done.token_ids)
    assert done.logprobs is None and done.cumulative_logprob is None and done.stop_reason is None
    assert done.finished()
    # The single-completion shortcuts read outputs[0].
    assert (out.text, out.token_ids, out.finish_reason) == (done.text, done.token_ids, done.finish_reason)


def test_vllm_field_names_are_all_there():
    vllm_request = {"request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished"}
    vllm_completion = {"index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason"}
    assert vllm_request <= {f.name for f in dataclasses.fields(RequestOutput)}
    assert vllm_completion <= {f.name for f in dataclasses.fields(CompletionOutput)}


def test_token_id_prompts_and_stop_reasons(llm):
    ids = llm.tokenizer.encode("1, 2, 3, 4,")
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, stop=[" 6"]))[0]
    assert out.prompt is None and out.prompt_token_ids == ids
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == " 6"
    assert " 6" not in out.outputs[0].text


def test_chat_reports_the_rendered_prompt(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.prompt == llm.tokenizer.apply_chat_template(messages)
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(messages)
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"


def test_streamed_outputs_have_the_same_shape(llm):
    engine = llm.engine
    engine.add_request("shape-1", "Once upon a time", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        seen += [o for o in engine.step() if o.request_id == "shape-1"]
    assert "".join(o.outputs[0].delta_text for o in seen) == seen[-1].outputs[0].text
    assert sum((o.outputs[0].delta_token_ids for o in seen), []) == seen[-1].outputs[0].token_ids
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]


def _python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_anygpu_loads_no_subpackage_until_used():
    loaded = _python(f"""
import json, sys
import anygpu
heavy = [m for m in sys.modules if m.split(".")[0] == "triton" or m.startswith("anygpu.kernels")
         or any(m == "anygpu." + p or m.startswith("anygpu." + p + ".") for p in {LAZY!r})]
print(json.dumps(heavy))""")
    assert loaded == []


def test_subpackages_are_reachable_from_the_top():
    got = _python(f"""
import json, torch
import anygpu
listed = sorted(set({LAZY!r}) & set(dir(anygpu)))  # before any is loaded
subs = {{p: getattr(anygpu, p).__name__ for p in {LAZY!r}}}
param = torch.nn.Parameter(torch.ones(64))
opt = anygpu.optim.AdamW8bit([param], lr=0.1)
param.grad = torch.ones(64)
opt.step()
print(json.dumps({{"subs": subs, "moved": bool((param < 1).all()), "dir": listed}}))""")
    assert got["subs"] == {p: f"anygpu.{p}" for p in LAZY}
    assert got["moved"]  # a real optimizer step ran
    assert got["dir"] == sorted(LAZY)


def test_unknown_attribute_still_raises():
    import anygpu

    with pytest.raises(AttributeError, match="no attribute 'optimm'"):
        anygpu.optimm  # noqa: B018
