"""The engine on a GPU (CUDA or ROCm): the same tokens as on the CPU, and decode graphs equal eager decoding."""

from __future__ import annotations

import pytest
import torch

from anygpu.engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 300, 42, 7, 99, 512, 3], list(range(10, 80)), [900, 4, 4, 4, 31]]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=64, num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=False,
                                   max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny-llama-gpu")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def tokens(engine: LLMEngine, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [out[str(i)] for i in range(len(PROMPTS))]


def test_gpu_fp32_tokens_equal_cpu(folder):
    cpu = tokens(LLMEngine(str(folder), device="cpu", progress=False))
    gpu = tokens(LLMEngine(str(folder), device="cuda", dtype="float32", progress=False, max_num_seqs=8,
                           max_num_batched_tokens=32, block_size=8))
    assert gpu == cpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_graphs_equal_eager(folder, dtype):
    eager = tokens(LLMEngine(str(folder), device="cuda", dtype=dtype, progress=False, max_num_seqs=8,
                             enforce_eager=True))
    engine = LLMEngine(str(folder), device="cuda", dtype=dtype, progress=False, max_num_seqs=8)
    assert engine.runner.graphs, "no decode graph was captured"
    assert tokens(engine) == eager


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_quantized_engine_runs(folder, quantize):
    engine = LLMEngine(str(folder), device="cuda", dtype="float16", progress=False, max_num_seqs=4, quantize=quantize)
    out = tokens(engine)
    assert all(len(t) == GREEDY.max_tokens for t in out)


def test_seeded_sampling_equal_alone_and_batched(folder):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    engine = LLMEngine(str(folder), device="cuda", dtype="float32", progress=False, max_num_seqs=8)
    batched = tokens(engine, params)
    engine.add_request("alone", PROMPTS[1], params)
    alone = None
    while engine.has_unfinished():
        alone = next((o.token_ids for o in engine.step() if o.finished), alone)
    assert alone == batched[1]
