"""Model families beyond Llama (Qwen3, Gemma 2, Gemma 3, Phi-3) against transformers' logits, on tiny random models the
test builds with transformers' own config classes and saves as Hugging Face folders (CPU, fp32).

Each family is loaded as a user would (``HFCheckpoint`` -> ``build_model``, and ``LLMEngine(folder)``), then:
- logits of three prompts run through every attention path: their first tokens packed in one prefill
  (flash_attn_varlen), the rest as a chunked prefill over the cache (paged_prefill), then greedy decode steps of
  the three together (paged_decode); the prompt rows against transformers' forward over the prompt, the decode
  rows against the logits of transformers' own cached decode steps (``generate(output_logits=True)``);
- the engine's greedy tokens against transformers' ``generate``.
Windows are made shorter than the prompts, so sliding layers are exercised; every family also runs on two
tensor-parallel ranks (gloo, CPU), and a Llama 3.1 GGUF with rope_freqs.weight loads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anygpu.engine import LLMEngine, SamplingParams
from anygpu.models import GGUFCheckpoint, HFCheckpoint, ModelConfig
from anygpu.models.llama import AttentionBatch
from anygpu.models.registry import build_model

transformers = pytest.importorskip("transformers")

VOCAB = 512
PROMPTS = [[5, 17, 300, 42, 7, 99, 411, 3, 250, 19, 8, 77, 123, 64],
           [9, 200, 31, 4, 18, 500, 61, 2],
           [44, 45, 46, 47, 300, 301, 302, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
DECODE_STEPS = 10
BLOCK = 4
TAIL = 3  # tokens of each prompt left for the chunked-prefill step


def save_tiny(tmp_path_factory, model_cls, config):
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # transformers initialises norms at 1 (or Gemma's at 0): make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    folder = tmp_path_factory.mktemp(type(model).__name__)
    model.save_pretrained(folder)
    return folder, model


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def our_logits(model, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Per prompt: logits [len + steps, vocab] over the prompt then its greedy continuation, computed in three
    kinds of step (prefill, mixed, decode) over a paged cache of BLOCK-token blocks."""
    cfg = model.config
    blocks = -(-(max(map(len, prompts)) + steps) // BLOCK)
    cache = torch.zeros(2, cfg.num_layers, blocks * len(prompts), BLOCK, cfg.num_kv_heads, cfg.head_dim)
    model.set_kv_caches([(cache[0, i], cache[1, i]) for i in range(cfg.num_layers)])
    tables = torch.arange(blocks * len(prompts), dtype=torch.int32).view(len(prompts), blocks)

    def run(seqs: list[list[int]], starts: list[int], mode: str) -> list[torch.Tensor]:
        ids = torch.tensor([t for s in seqs for t in s])
        pos = torch.cat([torch.arange(st, st + len(s)) for s, st in zip(seqs, starts)])
        seq_of = torch.cat([torch.full((len(s),), b) for b, s in enumerate(seqs)])
        slots = tables[seq_of, pos // BLOCK].long() * BLOCK + pos % BLOCK
        ends = [st + len(s) for s, st in zip(seqs, starts)]
        batch = AttentionBatch(positions=pos, slot_mapping=slots, mode=mode, cu_seqlens_q=_cu(list(map(len, seqs))),
                               max_seqlen_q=max(map(len, seqs)), seqlens_k=torch.tensor(ends, dtype=torch.int32),
                               max_seqlen_k=max(ends), block_tables=tables)
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, batch))
        return list(logits.split([len(s) for s in seqs]))

    heads = run([p[:-TAIL] for p in prompts], [0] * len(prompts), "prefill")
    tails = run([p[-TAIL:] for p in prompts], [len(p) - TAIL for p in prompts], "mixed")
    out = [torch.cat([h, t]) for h, t in zip(heads, tails)]
    for step in range(steps):
        nxt = [[int(o[-1].argmax())] for o in out]
        rows = run(nxt, [len(p) + step for p in prompts], "decode")
        out = [torch.cat([o, r]) for o, r in zip(out, rows)]
    return out


def check_logits(folder, hf, atol=2e-4, prompts=PROMPTS, max_position=None):
    """Our prompt rows against transformers' forward over the prompt, our decode rows against the logits of
    transformers' own decode steps (``generate`` through its KV cache, one token a call, as a user runs it)."""
    ckpt = HFCheckpoint(folder)
    ours = build_model(ckpt.config, ckpt.weights(progress=False), max_position=max_position)
    for prompt, got in zip(prompts, our_logits(ours, prompts, DECODE_STEPS)):
        with torch.inference_mode():
            prefill = hf(torch.tensor([prompt])).logits[0].float()
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS + 1, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ref = torch.cat([prefill, torch.cat(out.logits[1:]).float()])
        assert got.shape == ref.shape
        assert got[len(prompt) - 1:].argmax(-1).tolist() == out.sequences[0, len(prompt):].tolist()
        torch.testing.assert_close(got, ref, atol=atol, rtol=1e-4)
    return ckpt.config


def check_greedy(folder, hf, n: int = 16, prompts=PROMPTS[:2], tp: int = 1):
    engine = LLMEngine(str(folder), progress=False, block_size=BLOCK, tp=tp, device="cpu")
    try:
        done = _greedy(engine, prompts, n)
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert done[str(i)] == ref[0, len(prompt):].tolist()


def _greedy(engine, prompts, n):
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return done


SMALL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


# -- Qwen3 --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    cfg = transformers.Qwen3Config(**SMALL, head_dim=48, tie_word_embeddings=False, rope_theta=1e6)
    return save_tiny(tmp_path_factory, transformers.Qwen3ForCausalLM, cfg)


def test_qwen3_logits_equal_transformers(qwen3):
    cfg = check_logits(*qwen3)
    assert (cfg.architecture, cfg.head_dim, cfg.attention_bias, cfg.family.qk_norm) == ("qwen3", 48, False, True)


def test_qwen3_greedy_equals_transformers(qwen3):
    check_greedy(*qwen3)


def test_qwen3_config_keys():
    cfg = ModelConfig.from_hf(transformers.Qwen3Config(**SMALL, attention_bias=True, use_sliding_window=False,
                                                       sliding_window=64).to_dict())
    assert (cfg.attention_bias, cfg.sliding_window) == (True, None)


# -- Gemma 2 and Gemma 3 ------------------------------------------------------------------------------------------
GEMMA = dict(SMALL, head_dim=32, hidden_activation="gelu_pytorch_tanh", sliding_window=6, query_pre_attn_scalar=24,
             initializer_range=0.1,  # scores large enough for the soft-cap to bite
             num_hidden_layers=4)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    cfg = transformers.Gemma2Config(**GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=3.0)
    return save_tiny(tmp_path_factory, transformers.Gemma2ForCausalLM, cfg)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    cfg = transformers.Gemma3TextConfig(**GEMMA, sliding_window_pattern=2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return save_tiny(tmp_path_factory, transformers.Gemma3ForCausalLM, cfg)


def test_gemma2_logits_equal_transformers(gemma2):
    cfg = check_logits(*gemma2)
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.hidden_act) == ("gemma2", True, "gelu_tanh")
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scale) == (1.0, 3.0, 24 ** -0.5)
    assert cfg.sliding_layers == (True, False, True, False) and cfg.sliding_window == 6


def test_gemma2_greedy_equals_transformers(gemma2):
    check_greedy(*gemma2)


def test_gemma3_logits_equal_transformers(gemma3):
    cfg = check_logits(*gemma3)
    assert (cfg.architecture, cfg.rope_local_theta, cfg.rope_theta) == ("gemma3", 1e4, 1e6)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.sliding_layers == (True, False, True, False) and cfg.attn_softcap is None


def test_gemma3_greedy_equals_transformers(gemma3):
    check_greedy(*gemma3)


def test_gemma_4x_config_keys():
    """config.json as transformers 4.x wrote it for Gemma 3 (rope_local_base_freq, sliding_window_pattern)."""
    four = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
            "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
            "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06, "max_position_embeddings": 32768}
    cfg = ModelConfig.from_hf(four)
    assert cfg.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(26))
    assert (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling, cfg.tie_word_embeddings) == (1e4, 1e6, None, True)
    with pytest.raises(ValueError, match="hidden_activation: unsupported activation 'relu2'"):
        ModelConfig.from_hf({**four, "hidden_activation": "relu2"})
    with pytest.raises(ValueError, match="layer_types: expected a list of 26"):
        ModelConfig.from_hf({**four, "layer_types": ["full_attention"]})


# -- Phi-3 / Phi-4-mini -------------------------------------------------------------------------------------------
ORIGINAL = 24  # longrope's original_max_position_embeddings: contexts up to it use the short factors
LONG_PROMPTS = [[(7 * i + 3) % VOCAB for i in range(30)], [(11 * i + 5) % VOCAB for i in range(27)]]


def _phi3_config(**changes):
    rot = 32 * 3 // 4  # head_dim 32, partial_rotary_factor 0.75 (as Phi-4-mini)
    gen = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": ORIGINAL,
            "short_factor": (1 + torch.rand(rot // 2, generator=gen)).tolist(),
            "long_factor": (1 + 8 * torch.rand(rot // 2, generator=gen)).tolist()}
    # Phi3Config writes its own original_max_position_embeddings (default 4096) into rope_parameters: set it.
    return transformers.Phi3Config(**{**SMALL, "tie_word_embeddings": True, "rope_parameters": rope,
                                      "original_max_position_embeddings": ORIGINAL, "pad_token_id": 0, **changes})


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return save_tiny(tmp_path_factory, transformers.Phi3ForCausalLM, _phi3_config())


def test_phi3_logits_equal_transformers(phi3):
    # Long factors: the engine runs contexts past ORIGINAL (its max_model_len, 256, is), and so does
    # transformers once a sequence is longer than ORIGINAL (these prompts are).
    cfg = check_logits(*phi3, prompts=LONG_PROMPTS)
    # Short factors: a max_model_len of ORIGINAL, and sequences that stay within it as transformers sees them.
    assert all(len(p) + DECODE_STEPS <= ORIGINAL for p in PROMPTS[:2])
    check_logits(*phi3, prompts=PROMPTS[:2], max_position=ORIGINAL)
    assert (cfg.architecture, cfg.family.fused_checkpoint, cfg.rotary_dim) == ("phi3", True, 24)
    scaling = cfg.rope_scaling
    assert (scaling["rope_type"], scaling["original_max_position_embeddings"]) == ("longrope", ORIGINAL)


def test_phi3_greedy_equals_transformers(phi3):
    check_greedy(*phi3, prompts=LONG_PROMPTS)


def test_phi3_sliding_window_and_4x_keys(tmp_path_factory):
    folder, hf = save_tiny(tmp_path_factory, transformers.Phi3ForCausalLM,
                           _phi3_config(sliding_window=5, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0}))
    cfg = check_logits(folder, hf)
    assert (cfg.sliding_window, cfg.rope_scaling, cfg.rotary_dim) == (5, None, 32)
    # transformers 4.x: "su", original_max_position_embeddings and partial_rotary_factor at the top level
    four = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256, "rope_theta": 1e4,
            "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 12, "long_factor": [2.0] * 12}}
    cfg = ModelConfig.from_hf(four)
    assert cfg.rope_scaling == {"rope_type": "longrope", "short_factor": [1.0] * 12, "long_factor": [2.0] * 12,
                                "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="long_factor: expected 12 positive numbers"):
        ModelConfig.from_hf({**four, "rope_scaling": {**four["rope_scaling"], "long_factor": [2.0] * 16}})
    with pytest.raises(ValueError, match="rope_scaling.rope_type: 'dynamic' is not supported"):
        build_model(ModelConfig.from_hf({**four, "rope_scaling": {"type": "dynamic", "factor": 2.0}}), "random")


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_tensor_parallel_equals_transformers(family, request):
    """Two gloo ranks on the CPU: q/k norms replicated, Gemma's tied head cut into vocab rows, Phi-3's fused
    qkv_proj / gate_up_proj split into q/k/v and gate/up before each rank takes its heads and rows."""
    folder, hf = request.getfixturevalue(family)
    check_greedy(folder, hf, n=8, prompts=LONG_PROMPTS[:1] if family == "phi3" else PROMPTS[:1], tp=2)


def test_unsupported_settings_name_their_field():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(transformers.Gemma3TextConfig(**GEMMA, use_bidirectional_attention=True).to_dict())
    with pytest.raises(ValueError, match="'Gemma3ForConditionalGeneration'"):
        ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
    phi3 = ModelConfig.from_hf(_phi3_config().to_dict())
    bnb = dataclasses.replace(phi3, quantization=ModelConfig.from_hf(
        {**transformers.LlamaConfig(**SMALL).to_dict(), "architectures": ["LlamaForCausalLM"],
         "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}).quantization)
    with pytest.raises(ValueError, match="quantization_config: a bitsandbytes phi3 checkpoint"):
        build_model(bnb, "random")


# -- Llama 3.1+ GGUF with rope_freqs.weight ---------------------------------------------------------------------
def _permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's row order for q/k (the inverse of what the loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama31_gguf_rope_freqs_equal_transformers(tmp_path):
    """A tiny Llama with llama3 rope scaling, written as llama.cpp's converter writes it (q/k rows permuted, the
    scaling as a rope_freqs.weight of per-frequency divisors), against transformers' Llama with the scaling."""
    gguf = pytest.importorskip("gguf")
    from .test_gguf_types import HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, write_llama
    from .test_models_llama import hf_greedy

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # wavelengths 16..64 are the band
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS, vocab_size=258,
                                   max_position_embeddings=256, rope_parameters=rope, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, bos_token_id=256, eos_token_id=257)
    torch.manual_seed(4)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}
    gguf_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
                  "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
    tensors = {}
    for name, w in hf.state_dict().items():
        if name not in names:
            layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            names[name] = f"blk.{layer}.{gguf_names[module]}.weight"
            if module in ("self_attn.q_proj", "self_attn.k_proj"):
                w = _permute_qk(w, HEADS if module == "self_attn.q_proj" else KV_HEADS)
        tensors[names[name]] = (w.float().numpy().copy(), "F32")
    # convert_hf_to_gguf.py's rope_freqs for llama3 scaling
    head_dim, freqs = HIDDEN // HEADS, []
    for f in (1.0 / 10000.0 ** (torch.arange(0, HIDDEN // HEADS, 2, dtype=torch.float64) / head_dim)).tolist():
        wavelen = 2 * torch.pi / f
        smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
        freqs.append(1.0 if wavelen < 64 / 4.0 else 8.0 if wavelen > 64 else 1 / ((1 - smooth) / 8.0 + smooth))
    tensors["rope_freqs.weight"] = (torch.tensor(freqs, dtype=torch.float32).numpy(), "F32")
    path = write_llama(tmp_path / "llama31.gguf", tensors)
    assert any(t.name == "rope_freqs.weight" for t in gguf.GGUFReader(path).tensors)

    ckpt = GGUFCheckpoint(path)
    assert ckpt.config.rope_scaling["rope_type"] == "freq_factors"
    ours = build_model(ckpt.config, ckpt.weights(progress=False))
    ids = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101, 32, 99, 97, 116] * 4
    got = our_logits(ours, [ids], 0)[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    engine = LLMEngine(path, progress=False, block_size=BLOCK, max_model_len=128)
    engine.add_request("r", ids[:70], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    assert out.token_ids == hf_greedy(hf, ids[:70], 12)


def test_qwen3_sliding_window_from_max_window_layers(tmp_path_factory):
    """use_sliding_window: only the layers from max_window_layers on slide (with transformers 4.x keys too)."""
    cfg = transformers.Qwen3Config(**SMALL, head_dim=32, use_sliding_window=True, sliding_window=5,
                                   max_window_layers=1)
    folder, hf = save_tiny(tmp_path_factory, transformers.Qwen3ForCausalLM, cfg)
    ours = check_logits(folder, hf, prompts=PROMPTS[:1])
    assert (ours.sliding_window, ours.sliding_layers) == (5, (False, True, True))
    four = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"}
    assert ModelConfig.from_hf(four).sliding_layers == (False, True, True)
