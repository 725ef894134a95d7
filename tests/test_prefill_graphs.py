"""A lone prompt's prefill padded to a bucket's row count (``engine/prefill_graphs.py``): the padding is a second
sequence that writes no cache slot and changes none of the prompt's logits; which steps take the path; on a GPU,
the graphs' tokens equal eager steps' (which pad alike) and the replays really run.

On the CPU the runner has no prefill graphs; the tests install the same padded step by hand to hold its
semantics against the plain prefill.
"""

from __future__ import annotations

import gc

import pytest
import torch

from anygpu.engine import LLMEngine, SamplingParams
from anygpu.engine.prefill_graphs import BUCKETS, PrefillGraphs, bucket_of, buckets_for
from anygpu.models import ModelConfig
from anygpu.models.tokenizer import Tokenizer

CONFIG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position=512, tie_word_embeddings=False, attention_bias=False,
                     sliding_window=None, bos_token_id=1, eos_token_ids=(2,), dtype=None)
LENGTHS = (5, 16, 17, 40, 100)


def make(pad: bool, **kw) -> LLMEngine:
    torch.manual_seed(0)
    args = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=300, progress=False)
    args.update(kw)
    engine = LLMEngine("tiny", config=CONFIG, tokenizer=Tokenizer.synthetic(CONFIG.vocab_size, 2), **args)
    if pad:
        runner = engine.runner
        runner.prefill = PrefillGraphs(runner.model, runner.device, 256)
    return engine


def spy(engine: LLMEngine) -> list[int]:
    """The bucket of every padded prefill step."""
    seen, run = [], engine.runner.prefill.run

    def spied(ids, positions, slots, t):
        seen.append(t)
        return run(ids, positions, slots, t)

    engine.runner.prefill.run = spied
    return seen


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % (CONFIG.vocab_size - 3) + 3 for i in range(n)]


def one_at_a_time(engine: LLMEngine, params: SamplingParams) -> list:
    outs = []
    for i, n in enumerate(LENGTHS):
        engine.add_request(str(i), prompt(n, i), params)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    outs.append((c.token_ids, [[(t, lp.logprob) for t, lp in d.items()] for d in (c.logprobs or [])]))
    return outs


def test_buckets_stop_at_the_token_budget():
    assert buckets_for(100) == (16, 32, 64, 96)
    assert buckets_for(8192) == BUCKETS and BUCKETS[-1] == 512
    assert [bucket_of(buckets_for(100), n) for n in (1, 16, 17, 96, 97)] == [16, 16, 32, 96, None]


def test_padded_lone_prompts_give_the_plain_tokens_and_logprobs():
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    plain = one_at_a_time(make(False), params)
    engine = make(True)
    seen = spy(engine)
    padded = one_at_a_time(engine, params)
    assert seen == [16, 16, 32, 64, 128]  # one padded prefill a prompt, at the smallest bucket that holds it
    for (tokens, lps), (want_tokens, want_lps) in zip(padded, plain):
        assert tokens == want_tokens
        for step, want in zip(lps, want_lps):
            assert [t for t, _ in step] == [t for t, _ in want]
            assert [lp for _, lp in step] == pytest.approx([lp for _, lp in want], abs=1e-4)


def test_padding_writes_no_cache_slot():
    """The prompt's K/V land where the plain prefill puts them, and the padding's nowhere (slot -1)."""
    caches = []
    for pad in (False, True):
        engine = make(pad)
        engine.runner.kv_cache.zero_()
        engine.add_request("a", prompt(20), SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished():
            engine.step()
        caches.append(engine.runner.kv_cache.clone())
    plain, padded = caches
    written = plain.abs().sum(dim=(0, 1, 4, 5)).flatten() != 0  # per slot: 20 of them
    assert int(written.sum()) == 20
    assert torch.equal(padded.abs().sum(dim=(0, 1, 4, 5)).flatten() != 0, written)
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)


def test_only_lone_fresh_prompts_take_the_path():
    engine = make(True, max_num_batched_tokens=256)
    seen = spy(engine)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i in range(3):  # arriving together: one batched prefill
        engine.add_request(f"b{i}", prompt(10, i), params)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("long", prompt(257), params)  # past the budget's largest bucket (256): eager, unpadded
    engine.add_request("echo", prompt(12), SamplingParams(max_tokens=1, prompt_logprobs=1))  # every row's logits
    while engine.has_unfinished():
        engine.step()
    assert seen == []


# -- on a GPU ---------------------------------------------------------------------------------------------

def _gpu_tokens(dtype: str, **kw) -> tuple[list, list[int], list[int]]:
    engine = LLMEngine("tiny", config=CONFIG, tokenizer=Tokenizer.synthetic(CONFIG.vocab_size, 2), device="cuda",
                       dtype=dtype, max_num_seqs=4, max_model_len=300, num_kv_blocks=128, progress=False, **kw)
    try:
        seen = spy(engine)
        out = one_at_a_time(engine, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        replayed = sorted(engine.runner.prefill.graphs)
        return out, seen, replayed
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (prefill graphs)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_prefill_graphs_equal_eager(dtype):
    eager, seen_eager, none = _gpu_tokens(dtype, enforce_eager=True)
    graphs, seen, captured = _gpu_tokens(dtype)
    assert none == [] and captured == list(buckets_for(300))  # capped by max_model_len
    assert seen == seen_eager == [16, 16, 32, 64, 128]
    assert graphs == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (prefill graphs)")
def test_gpu_references_prefill_eagerly(monkeypatch):
    """Attention's reference reads the sequence bounds on the host, which a graph cannot capture: no prefill
    graphs then (the engine still starts), and the prompts are padded alike."""
    monkeypatch.setenv("ANYGPU_KERNELS", "reference")
    out, seen, captured = _gpu_tokens("float32")
    assert captured == [] and seen == [16, 16, 32, 64, 128]
    assert all(len(tokens) == 8 for tokens, _ in out)
