"""anygpu.models.gguf: dequantization bit-identical to gguf's numpy, Q/K un-permuted as transformers does it, names,
config, and the errors for files this loader cannot read."""

import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from anygpu.models import GGUFCheckpoint, ModelConfig, open_checkpoint  # noqa: E402
from anygpu.models.gguf import dequantize, hf_name  # noqa: E402

from ._models_fixtures import hf_config, smollm, smollm_path  # noqa: E402,F401 - fixtures

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def _bits_equal(a: torch.Tensor, b) -> bool:
    b = torch.as_tensor(np.ascontiguousarray(b), dtype=torch.float32)
    return a.dtype == torch.float32 and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _quantized(rows: int, cols: int, name: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # rows of very different scales, a zero block and a constant block: scales, mins and rounding edges
    x = (rng.standard_normal((rows, cols)) * np.logspace(-3, 2, rows)[:, None]).astype(np.float32)
    if rows > 1:
        x[0, :32], x[1, :32] = 0.0, 0.75
    return x if name == "F32" else gguf.quants.quantize(x, QT[name])


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_random_bit_identical(name):
    q = _quantized(16, 96, name)
    ours = dequantize(torch.from_numpy(q.reshape(-1)).view(torch.uint8), name, (16, 96))
    assert _bits_equal(ours, gguf.quants.dequantize(q, QT[name]))


def _transformers_reference(tensor, config):
    """gguf's numpy dequantization, then transformers' own reverse permutation of q/k (its LlamaTensorProcessor)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    processor = LlamaTensorProcessor(config={"num_attention_heads": config.num_heads,
                                             "num_key_value_heads": config.num_kv_heads})
    return processor.process(w, tensor.name).weights


def _reader_tensors(path):
    """gguf-py's own view of the file's tensors (the oracle's input)."""
    return list(gguf.GGUFReader(path, "c").tensors)


def test_real_tensors_equal_transformers(smollm):
    """Every tensor of the first and last layers, the embedding (Q8_0) and the final norm."""
    pytest.importorskip("transformers")
    tensors = _reader_tensors(smollm.path)
    checked = 0
    for (name, w), t in zip(smollm.weights(progress=False), tensors):
        assert name == hf_name(t.name)
        if t.name.startswith(("blk.0.", "blk.29.", "token_embd", "output_norm")):
            assert _bits_equal(w, _transformers_reference(t, smollm.config)), (name, t.name)
            checked += 1
    assert checked == 2 + 2 * 9
    assert {t.tensor_type.name for t in tensors} == {"F32", "Q4_1", "Q8_0"}


def test_names_and_shapes_match_transformers_llama(smollm, hf_config):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in LlamaForCausalLM(hf_config).state_dict().items()}
    expected.pop("lm_head.weight")  # tied: the file has no output.weight
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in _reader_tensors(smollm.path)}
    assert shapes == {t.name: t.shape for t in smollm.tensors}  # our parser's table equals gguf-py's
    assert {hf_name(n): s for n, s in shapes.items()} == expected


def test_config_equals_transformers(smollm, hf_config):
    ours = smollm.config
    assert ours == ModelConfig.from_hf(hf_config.to_dict())  # the same model seen through config.json keys
    assert (ours.architecture, ours.num_layers, ours.num_heads, ours.num_kv_heads) == ("llama", 30, 9, 3)
    assert ours.head_dim == 64
    assert (ours.rope_theta, ours.rope_scaling, ours.tie_word_embeddings, ours.dtype) == (100000.0, None, True, None)


def test_open_checkpoint_default(smollm_path, monkeypatch):
    monkeypatch.delenv("ANYGPU_MODEL", raising=False)
    from anygpu.models import default_model_path

    assert default_model_path() == smollm_path
    monkeypatch.setenv("ANYGPU_MODEL", str(smollm_path.parent / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="nope.gguf.*ANYGPU_MODEL"):
        open_checkpoint(None)


# --- small files written with gguf.GGUFWriter ---

def _write(path, arch="llama", tensors=None, meta=None):
    """A 1-layer model (hidden 32, 2 heads of 16, 1 kv head) with a 258-token byte-level vocabulary."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "embedding_length": 32, "feed_forward_length": 64, "context_length": 128,
                       "attention.head_count": 2, "attention.head_count_kv": 1, **(meta or {})}.items():
        w.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.UINT32)
    w.add_tokenizer_model("gpt2")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    w.add_token_list(alphabet + ["<s>", "</s>"])
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    for name, (array, qtype) in (tensors or {}).items():
        w.add_tensor(name, array, raw_dtype=None if qtype in ("F32", "F16") else QT[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LAYER = {  # name: (torch shape, type)
    "token_embd.weight": ((258, 32), "Q8_0"), "output.weight": ((258, 32), "BF16"),
    "blk.0.attn_q.weight": ((32, 32), "Q4_0"), "blk.0.attn_k.weight": ((16, 32), "Q4_1"),
    "blk.0.attn_v.weight": ((16, 32), "F16"), "blk.0.attn_output.weight": ((32, 32), "Q8_0"),
    "blk.0.attn_q.bias": ((32,), "F32"), "blk.0.attn_k.bias": ((16,), "F32"), "blk.0.attn_v.bias": ((16,), "F32"),
    "blk.0.ffn_gate.weight": ((64, 32), "Q4_1"), "blk.0.ffn_up.weight": ((64, 32), "Q4_0"),
    "blk.0.ffn_down.weight": ((32, 64), "BF16"), "blk.0.attn_norm.weight": ((32,), "F32"),
    "blk.0.ffn_norm.weight": ((32,), "F32"), "output_norm.weight": ((32,), "F32"),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_file_every_type(tmp_path, arch):
    pytest.importorskip("transformers")
    tensors = {}
    for i, (name, (shape, qtype)) in enumerate(LAYER.items()):
        q = _quantized(int(np.prod(shape[:-1])), shape[-1], qtype, seed=i).reshape(*shape[:-1], -1)
        tensors[name] = (q.astype(np.float16) if qtype == "F16" else q, qtype)
    ckpt = GGUFCheckpoint(_write(tmp_path / "m.gguf", arch, tensors))
    cfg = ckpt.config
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.vocab_size) == (arch, 16, 1, 258)
    assert cfg.attention_bias and not cfg.tie_word_embeddings  # from the tensors: q bias, output.weight
    assert (ckpt.tokenizer.bos_token_id, ckpt.tokenizer.eos_token_ids, cfg.eos_token_ids) == (256, (257,), (257,))
    by_gguf = {t.name: t for t in _reader_tensors(ckpt.path)}
    got = dict(ckpt.weights(progress=False))
    assert len(got) == len(LAYER)
    for t in by_gguf.values():
        expected = (_transformers_reference(t, cfg) if arch == "llama"  # only llama's q/k are permuted
                    else gguf.quants.dequantize(by_gguf[t.name].data, t.tensor_type))
        assert _bits_equal(got[hf_name(t.name)], expected), t.name
    permuted = got["model.layers.0.self_attn.q_proj.weight"]
    raw = torch.from_numpy(gguf.quants.dequantize(by_gguf["blk.0.attn_q.weight"].data, QT.Q4_0))
    assert torch.equal(permuted, raw) == (arch == "qwen2")


def test_unsupported_tensor_type(tmp_path):
    q8k = np.zeros((32, 292), np.uint8)  # one Q8_K block (256 values, 292 bytes) per row: llama.cpp-internal
    path = _write(tmp_path / "k.gguf", tensors={"blk.0.attn_q.weight": (q8k, "Q8_K")})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*Q8_K.*not supported.*Q6_K"):
        GGUFCheckpoint(path)


def test_unsupported_tensor_and_architecture(tmp_path):
    # (rope_freqs.weight loads since Llama 3.1 GGUFs run: tests/test_models_families.py; Phi-3's long/short
    # factor tensors do not)
    path = _write(tmp_path / "r.gguf", tensors={"rope_factors_long.weight": (np.ones(8, np.float32), "F32")})
    with pytest.raises(ValueError, match="rope_factors_long.weight"):
        GGUFCheckpoint(path)
    with pytest.raises(ValueError, match="'phi2'.*llama"):
        GGUFCheckpoint(_write(tmp_path / "g.gguf", arch="phi2"))


def test_bad_files(tmp_path, smollm_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        GGUFCheckpoint(tmp_path / "missing.gguf")
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all" * 10)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with open(smollm_path, "rb") as f:
        (tmp_path / "truncated.gguf").write_bytes(f.read(100_000))  # cut inside the tokenizer strings
    for name in ("garbage.gguf", "empty.gguf", "truncated.gguf"):
        with pytest.raises(ValueError, match=f"{name}: not a readable GGUF file"):
            open_checkpoint(tmp_path / name)
