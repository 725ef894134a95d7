"""Greedy tokens from inside the decode graph (issue 27): each captured decode graph also computes the argmax of
its logits, and a step whose sequences are all plainly greedy samples those ids instead of launching an argmax
after the replay.  On a GPU: the tokens (and the log-probabilities of the steps that need the logits) equal
those of the same engine with ``runner.graph_argmax = False`` and of eager decoding.  On the CPU (no graphs): the
runner hands a graph's ids to the sampler exactly when every row is plainly greedy, through a stand-in graph.

    .venv/bin/python -m pytest -q tests/test_engine_graph_sampling_gpu.py      # on a CUDA or ROCm machine
"""

from __future__ import annotations

import gc

import pytest
import torch

from anygpu.engine import LLMEngine, SamplingParams
from anygpu.models import ModelConfig

PROMPTS = [[5, 17, 300, 42, 7, 99, 512, 3], list(range(10, 80)), [900, 4, 4, 4, 31], [1, 2, 3], [700] * 20]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _run(engine: LLMEngine, params_of) -> dict[str, list]:
    """Every prompt with params_of(i); request id -> (tokens, logprobs)."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params_of(i))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, c.logprobs)
    return out


def _spy(engine: LLMEngine) -> list:
    """Records, per sampler call, whether it was given the graph's ids."""
    calls = []
    sample_each = engine.runner.sampler.sample_each

    def spied(logits, seqs, greedy=None):
        calls.append(greedy is not None)
        return sample_each(logits, seqs, greedy)

    engine.runner.sampler.sample_each = spied
    return calls


# -- on a GPU ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=64, num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=False,
                                   max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny-llama-graph-sampling")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _gpu_run(folder, dtype, params_of, graph_argmax=True, **kw):
    """(outputs, the sampler's calls) of a fresh engine, which is released before returning: the next one sizes
    its KV cache from the memory left."""
    engine = LLMEngine(str(folder), device="cuda", dtype=dtype, progress=False, max_num_seqs=8, **kw)
    try:
        if not kw.get("enforce_eager"):
            assert engine.runner.graphs, "no decode graph was captured"
        engine.runner.graph_argmax = graph_argmax
        engine.run_ahead = False  # the sampler's shortcut is what is tested here (run-ahead: test_engine_run_ahead)
        calls = _spy(engine)
        out = _run(engine, params_of)
        if graph_argmax and engine.runner.graphs:  # the replayed graph's ids are the argmax of its logits rows
            _, logits, greedy = engine.runner.graphs[engine.runner._graph_size(len(PROMPTS))]
            assert torch.equal(greedy[:len(PROMPTS)], logits[:len(PROMPTS)].argmax(dim=-1))
        return out, calls
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_argmax_tokens_equal_sampler_argmax(folder, dtype):
    """All greedy: every decode step takes the graph's ids; the tokens equal the sampler's own argmax of the same
    graph's logits, and (fp32) eager decoding's."""
    on, calls = _gpu_run(folder, dtype, lambda i: GREEDY)
    assert sum(calls) == GREEDY.max_tokens - 1  # every decode step (the first token comes from the prefill)
    off, calls = _gpu_run(folder, dtype, lambda i: GREEDY, graph_argmax=False)
    assert not any(calls) and off == on
    if dtype == "float32":
        assert _gpu_run(folder, dtype, lambda i: GREEDY, enforce_eager=True)[0] == on


@pytest.mark.gpu
def test_steps_that_are_not_plainly_greedy_sample_the_logits(folder):
    """A batch with a sampled row, or a greedy row that asks for log-probabilities, samples the logits: the same
    tokens and log-probabilities with the graph's argmax on or off."""
    def params_of(i):
        if i == 1:
            return SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
        if i == 3:
            return SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True)
        return GREEDY

    on, calls = _gpu_run(folder, "float32", params_of)
    assert sum(calls) == GREEDY.max_tokens - 1  # the ids came with every decode step, and were not taken
    assert _gpu_run(folder, "float32", params_of, graph_argmax=False)[0] == on
    assert on["3"][1] is not None and len(on["3"][1]) == GREEDY.max_tokens


# -- on the CPU: the runner's plumbing, through a stand-in graph -------------------------------------------

CONFIG = ModelConfig(architecture="llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position=512, tie_word_embeddings=False, attention_bias=False,
                     sliding_window=None, bos_token_id=1, eos_token_ids=(2,), dtype=None)


class _Graph:
    def reset(self):
        pass


def _stand_in_graph(engine: LLMEngine) -> list:
    """The runner's decode steps through a stand-in for a captured graph: the eager forward, and as its "argmax"
    the argmax plus one (mod vocab), so a token taken from the graph's ids shows.  Returns the log of each
    replay's (argmax, ids handed out)."""
    runner, log = engine.runner, []

    def replay(ids, attn):
        logits = runner.model.compute_logits(runner.model(ids, attn))
        argmax = logits.argmax(dim=-1)
        shifted = (argmax + 1) % logits.shape[1]
        log.append((argmax.tolist(), shifted.tolist()))
        return logits, shifted

    runner.graphs = {runner.max_num_seqs: (_Graph(), None, None)}
    runner._replay = replay
    return log


def _cpu_engine() -> LLMEngine:
    torch.manual_seed(0)
    return LLMEngine("tiny", config=CONFIG, device="cpu", max_num_seqs=8, max_model_len=128, progress=False)


@pytest.mark.parametrize("flag", [True, False])
def test_runner_hands_graph_ids_to_the_sampler_when_all_greedy(flag):
    engine = _cpu_engine()
    engine.runner.graph_argmax = flag
    log = _stand_in_graph(engine)
    out = _run(engine, lambda i: GREEDY)
    assert len(log) == GREEDY.max_tokens - 1  # every decode step replayed the stand-in
    for i in range(len(PROMPTS)):
        tokens = out[str(i)][0]
        taken = [step[1 if flag else 0][i] for step in log]  # the graph's ids, or the logits' argmax
        assert tokens[1:] == taken


def test_runner_samples_the_logits_when_a_row_is_not_plainly_greedy():
    engine = _cpu_engine()
    log = _stand_in_graph(engine)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    out = _run(engine, lambda i: sampled if i == 2 else GREEDY)
    assert len(log) == GREEDY.max_tokens - 1
    for i in (0, 1, 3, 4):
        assert out[str(i)][0][1:] == [step[0][i] for step in log]  # the argmax of the logits, not the graph's ids
