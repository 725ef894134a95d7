"""Every common GGUF type: the torch block decoders bit-identical to ``gguf.quants.dequantize`` on random blocks, and
a tiny random Llama written with ``gguf.GGUFWriter`` in each type, run by anygpu, against transformers.

The files are made here (tmp_path): tensors quantized with ``gguf.quants.quantize`` where gguf-py can (Q4_0..Q8_0),
else random valid blocks (K-quants, IQ4: gguf-py only decodes those), with fp16 scales sized so weights stay
near 0.3 in magnitude.  References: transformers' LlamaForCausalLM on the same file's tensors dequantized by
``gguf.quants`` (and un-permuted by transformers' own GGUF code), and, for Q4_K and Q8_0, transformers' own GGUF
loading of the whole file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from anygpu.models import GGUFCheckpoint  # noqa: E402
from anygpu.models.gguf import hf_name  # noqa: E402
from anygpu.models.registry import build_model  # noqa: E402
from anygpu.quant import gguf_blocks  # noqa: E402
from anygpu.quant.gguf_blocks import BLOCK_SHAPES, dequantize_blocks  # noqa: E402

QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
GGUF_QUANTIZES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # types gguf.quants can encode
# Byte offsets of each block's fp16 scales, and the largest |integer factor| a scale multiplies (to size them).
SCALES = {"Q4_0": ([0], 8), "Q4_1": ([0, 2], 15), "Q5_0": ([0], 16), "Q5_1": ([0, 2], 31), "Q8_0": ([0], 127),
          "Q2_K": ([80, 82], 45), "Q3_K": ([108], 128), "Q4_K": ([0, 2], 945), "Q5_K": ([0, 2], 1953),
          "Q6_K": ([208], 4064), "IQ4_NL": ([0], 127), "IQ4_XS": ([0], 4064)}


def _random_blocks(name: str, n: int, rng, magnitude: float = 0.3) -> np.ndarray:
    """n valid blocks of ``name``: random bits, finite fp16 scales (some negative, some zero) of ~magnitude."""
    _, size = BLOCK_SHAPES[name]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    offsets, factor = SCALES[name]
    for off in offsets:
        d = (rng.uniform(-1, 1, n) * magnitude / factor).astype(np.float16)
        d[::7] = 0  # all-zero scales: a block that decodes to its mins (or to zeros)
        blocks[:, off: off + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("name", QUANTIZED)
def test_random_blocks_bit_identical(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    blocks = _random_blocks(name, 96, rng)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, QT[name]).reshape(-1))
    ours = dequantize_blocks(torch.from_numpy(blocks.reshape(-1)), name)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert torch.equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("name", sorted(GGUF_QUANTIZES))
def test_quantized_by_gguf_bit_identical(name):
    """Blocks from gguf's own quantizer: real scale/min patterns, rows of very different magnitudes."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 256)) * np.logspace(-3, 2, 8)[:, None]).astype(np.float32)
    q = gguf.quants.quantize(x, QT[name])
    ours = dequantize_blocks(torch.from_numpy(q.reshape(-1)), name)
    assert torch.equal(_bits(ours), _bits(torch.from_numpy(gguf.quants.dequantize(q, QT[name]).reshape(-1))))


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "F16"])
def test_chunks_and_out_dtype(name, monkeypatch):
    """A tensor decoded in many chunks equals one decoded whole; ``out`` in bf16 holds the fp32 values rounded."""
    rng = np.random.default_rng(5)
    if name == "F16":
        raw = torch.from_numpy(rng.standard_normal(4096).astype(np.float16).view(np.uint8))
    else:
        raw = torch.from_numpy(_random_blocks(name, 64, rng).reshape(-1))
    whole = dequantize_blocks(raw, name)
    monkeypatch.setattr(gguf_blocks, "CHUNK_ELEMENTS", 300)  # not a multiple of any block: ragged last chunk
    assert torch.equal(_bits(dequantize_blocks(raw, name)), _bits(whole))
    out = torch.empty(whole.numel(), dtype=torch.bfloat16)
    assert dequantize_blocks(raw, name, out=out) is out
    assert torch.equal(out, whole.to(torch.bfloat16))


def test_block_errors():
    with pytest.raises(ValueError, match=r"Q6_K: .*whole blocks of 210, got 400 "):
        dequantize_blocks(torch.zeros(400, dtype=torch.uint8), "Q6_K")
    with pytest.raises(ValueError, match="Q8_1 is not supported"):
        dequantize_blocks(torch.zeros(36, dtype=torch.uint8), "Q8_1")
    with pytest.raises(ValueError, match="out has 10 elements, the blocks hold 256"):
        dequantize_blocks(torch.zeros(144, dtype=torch.uint8), "Q4_K", out=torch.empty(10))


# --- a tiny random Llama in every type ---

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # rows of 256 and 512: whole K-quant blocks
VOCAB = 258  # the 256 byte-level tokens, <s>, </s>


def _tensors(qtype: str, seed: int) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (array as the writer takes it, type).  Norms F32; every matrix in ``qtype``."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * 64, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * 64, HIDDEN),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_gate.weight": (INTER, HIDDEN),
                       f"blk.{i}.ffn_up.weight": (INTER, HIDDEN), f"blk.{i}.ffn_down.weight": (HIDDEN, INTER)})
    out = {}
    for name, (rows, cols) in shapes.items():
        if qtype in GGUF_QUANTIZES:
            x = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
            out[name] = (gguf.quants.quantize(x, QT[qtype]), qtype)
        else:
            block, size = BLOCK_SHAPES[qtype]
            out[name] = (_random_blocks(qtype, rows * cols // block, rng).reshape(rows, -1), qtype)
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(LAYERS) for n in ("attn", "ffn")]:
        out[name] = ((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "F32")
    return out


def write_llama(path, tensors) -> str:
    from tests._gguf_writer import add_byte_vocab

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    add_byte_vocab(w)
    for name, (array, qtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=None if qtype == "F32" else QT[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _reference_model(path: str):
    """transformers' Llama on gguf.quants' dequantization of the file, q/k un-permuted by transformers."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS, vocab_size=VOCAB,
                                   max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, bos_token_id=256, eos_token_id=257)
    processor = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    state = {}
    for t in gguf.GGUFReader(path, "c").tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        state[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(processor.process(w, t.name).weights))
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def _logits(hf, ids) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101, 32, 99, 97, 116]


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_tiny_llama_every_type_equals_reference(tmp_path, qtype):
    from .test_models_llama import full_logits

    path = write_llama(tmp_path / f"tiny.{qtype}.gguf", _tensors(qtype, seed=QUANTIZED.index(qtype)))
    ckpt = GGUFCheckpoint(path)
    assert {t.type_name for t in ckpt.tensors} == {qtype, "F32"}
    ref = _reference_model(path)
    # the weights themselves, bit for bit (after the same un-permutation)
    ours_w = dict(ckpt.weights(progress=False))
    for name, p in ref.state_dict().items():
        assert torch.equal(_bits(ours_w[name]), _bits(p)), name
    got = full_logits(build_model(ckpt.config, iter(ours_w.items())), IDS)
    expected = _logits(ref, IDS)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=2e-5 * max(scale, 1.0), rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_tiny_llama_equals_transformers_gguf_loading(tmp_path, qtype):
    """transformers reads the whole file itself (config, names, permutation, dequantization)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from anygpu.engine import LLMEngine, SamplingParams

    from .test_models_llama import full_logits, hf_greedy

    path = write_llama(tmp_path / f"tiny.{qtype}.gguf", _tensors(qtype, seed=11))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"tiny.{qtype}.gguf",
                                                       dtype=torch.float32).eval()
    ckpt = GGUFCheckpoint(path)
    got = full_logits(build_model(ckpt.config, ckpt.weights(progress=False)), IDS)
    expected = _logits(hf, IDS)
    torch.testing.assert_close(got, expected, atol=2e-5 * max(expected.abs().max().item(), 1.0), rtol=1e-4)
    # and the engine, end to end: greedy tokens past EOS equal transformers' generate
    engine = LLMEngine(path, progress=False, block_size=4, max_model_len=64)
    engine.add_request("r", IDS[:8], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    assert out.token_ids == hf_greedy(hf, IDS[:8], 12)


# --- files whose tensor bytes do not fit their type: errors name the file, the tensor and the type ---

def _patch_dim0(path, tensor: str, value: int) -> None:
    """Overwrite ne0 (the row length) of ``tensor`` in the file's tensor table."""
    data = bytearray(open(path, "rb").read())
    name = tensor.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4  # past the name and n_dims
    data[at: at + 8] = value.to_bytes(8, "little")
    open(path, "wb").write(bytes(data))


def test_row_length_not_whole_blocks(tmp_path):
    path = write_llama(tmp_path / "rows.gguf", _tensors("Q4_K", seed=1))
    _patch_dim0(path, "blk.1.ffn_down.weight", 500)
    with pytest.raises(ValueError, match=r"rows\.gguf: tensor blk\.1\.ffn_down\.weight \(Q4_K\) has rows of 500 "
                                         r"values, not a whole number of Q4_K blocks of 256"):
        GGUFCheckpoint(path)


def test_tensor_past_the_end(tmp_path):
    path = write_llama(tmp_path / "cut.gguf", _tensors("Q6_K", seed=2))
    last = max(GGUFCheckpoint(path).tensors, key=lambda t: t.offset)
    with open(path, "r+b") as f:
        f.truncate(last.offset + last.nbytes - 1)
    with pytest.raises(ValueError, match=rf"cut\.gguf: tensor {last.name} \({last.type_name}, shape .*needs "
                                         rf"{last.nbytes} bytes.*file ends.*truncated"):
        GGUFCheckpoint(path)


def test_bigger_row_overlaps_next_tensor(tmp_path):
    """A row length doubled in the table: the tensor's bytes would run into the next one's."""
    path = write_llama(tmp_path / "big.gguf", _tensors("IQ4_XS", seed=3))
    _patch_dim0(path, "blk.0.attn_q.weight", 2 * HIDDEN)
    with pytest.raises(ValueError, match=r"big\.gguf: tensor blk\.0\.attn_q\.weight \(IQ4_XS, \d+ bytes at \d+\) "
                                         r"overlaps tensor"):
        GGUFCheckpoint(path)


def test_counts_bounded_by_the_file(tmp_path):
    path = write_llama(tmp_path / "n.gguf", _tensors("Q8_0", seed=4))
    data = bytearray(open(path, "rb").read())
    data[16:24] = (2**40).to_bytes(8, "little")  # metadata item count
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"n\.gguf: not a readable GGUF file \(truncated"):
        GGUFCheckpoint(path)
