"""GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 kept packed on the CPU (``anygpu.quant.gguf_int4pack``,
``anygpu.nn.GGUFLinear``): products against ``gguf.quants``' dequantized weights under the accuracy rule (bf16
compute), stacking and row orders, errors, and the engine's default model running on packed layers.  The
K-quants and IQ4 (random blocks: gguf-py cannot encode them) are in tests/test_gguf_kquants_packed.py."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from anygpu.quant import gguf_int4pack as P  # noqa: E402
from anygpu.testing import assert_accurate  # noqa: E402

from ._models_fixtures import smollm_path  # noqa: E402, F401 - fixture

pytestmark = pytest.mark.skipif(not P.supported(), reason="this torch has no CPU int4 matmul")


def _weight(name, n, k, rng):
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))).astype(np.float32)
    w[:, :32] += 0.05  # a group with an offset: Q4_1's zero point at work
    blocks = gguf.quants.quantize(w, QT[name])
    dq = torch.from_numpy(gguf.quants.dequantize(blocks, QT[name]).reshape(n, k).copy())
    return torch.from_numpy(blocks.reshape(-1).copy()), dq


GGUF_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the packed types gguf.quants can encode


@pytest.mark.parametrize("name", GGUF_QUANTIZES)
@pytest.mark.parametrize("m,k", [(1, 576), (3, 1536), (17, 96)])
def test_stacked_product_matches_gguf_dequantized(name, m, k):
    rng = np.random.default_rng(m * k + len(name))
    raws, refs = zip(*(_weight(name, n, k, rng) for n in (128, 64, 48)))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))  # a row order, as for q/k heads
    parts = [P.decode(raws[0], name, 128, k), P.decode(raws[1], name, 64, k, order), P.decode(raws[2], name, 48, k)]
    w = torch.cat([refs[0], refs[1][order], refs[2]])
    x = torch.randn(m, k).bfloat16()
    ours = P.matmul(x, P.pack(parts), w.shape[0])
    assert ours.dtype == torch.bfloat16 and ours.shape == (m, 240)
    assert_accurate(ours, x @ w.bfloat16().T, x.double() @ w.double().T, what=f"{name} m={m} k={k}")
    # fp32 x goes in as two bf16 halves: at least as accurate as bf16 (its products still round to bf16)
    x32 = torch.randn(m, k)
    y32 = P.matmul(x32, P.pack(parts), w.shape[0])
    assert y32.dtype == torch.float32
    assert_accurate(y32.bfloat16(), x32.bfloat16() @ w.bfloat16().T, x32.double() @ w.double().T, what="fp32 x")


@pytest.mark.parametrize("m", [1, 3, 17])  # 17: past the rows split into the kept buffer
def test_fp32_x_same_bits_under_inference_mode(m):
    """The engine's steps run under inference mode, where a decode-sized fp32 x is split into a buffer kept per
    thread: the same bits as the plain split, and a later call (another x, another k) leaves an earlier result
    alone."""
    rng = np.random.default_rng(m)
    segments = {k: P.pack([P.decode(_weight("Q4_1", 64, k, rng)[0], "Q4_1", 64, k)]) for k in (96, 192)}
    xs = [torch.randn(m, k) for k in (96, 192, 96)]
    plain = [P.matmul(x, segments[x.shape[1]], 64) for x in xs]
    with torch.inference_mode():
        ours = [P.matmul(x, segments[x.shape[1]], 64) for x in xs]
    for a, b in zip(plain, ours):
        assert torch.equal(a, b)


def test_errors_name_the_argument():
    raw, _ = _weight("Q4_0", 16, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="type_name"):
        P.decode(raw, "F16", 16, 64)
    with pytest.raises(ValueError, match="in_features"):
        P.decode(raw, "Q4_0", 16, 48)
    with pytest.raises(ValueError, match="out_features"):
        P.pack([P.decode(raw[: 8 * 2 * 18], "Q4_0", 8, 64)])
    q8, _ = _weight("Q8_0", 16, 64, np.random.default_rng(1))
    with pytest.raises(ValueError, match="out_features"):  # 8 Q8_0 rows: a segment of their own
        P.pack([P.decode(raw, "Q4_0", 16, 64), P.decode(q8[: 8 * 2 * 34], "Q8_0", 8, 64)])
    assert [sz.shape[1] for _, sz, _ in P.pack([P.decode(raw, "Q4_0", 16, 64), P.decode(q8, "Q8_0", 16, 64)])] \
        == P.segment_rows([("Q4_0", 16), ("Q8_0", 16)]) == [16, 16]


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_embedding_rows_are_the_gguf_values(name):
    from anygpu.nn.embedding_gguf import GGUFEmbedding
    from anygpu.quant.gguf_blocks import dequantize_blocks

    from .test_gguf_types import _random_blocks

    raw = torch.from_numpy(_random_blocks(name, 40 * 256 // gguf.constants.GGML_QUANT_SIZES[QT[name]][0],
                                          np.random.default_rng(3)).reshape(-1).copy())
    table = torch.from_numpy(gguf.quants.dequantize(raw.numpy().reshape(40, -1), QT[name]).reshape(40, 256))
    emb = GGUFEmbedding(raw, name, 40, 256)
    ids = torch.tensor([[3, 0, 39], [3, 7, 7]])
    assert torch.equal(emb(ids), table[ids])
    assert torch.equal(dequantize_blocks(raw, name).view(40, 256), table)
    with pytest.raises(ValueError, match="blocks"):
        GGUFEmbedding(raw, name, 41, 256)


def test_default_model_runs_packed(smollm_path, monkeypatch):  # noqa: F811
    from anygpu import LLM
    from anygpu.engine import SamplingParams
    from anygpu.nn.embedding_gguf import GGUFEmbedding
    from anygpu.nn.linear_gguf import GGUFLinear

    monkeypatch.setenv("ANYGPU_CPU_GGUF_PACKED", "1")
    llm = LLM(str(smollm_path), progress=False, max_model_len=128)
    model = llm.engine.model if hasattr(llm, "engine") else llm.model
    packed = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    cfg = model.config
    assert len(packed) == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down per layer, and the (tied Q8_0) head
    assert all(len(m.layouts) == 1 for m in packed)  # one type a projection: one call
    assert not any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for m in model.modules())
    assert isinstance(model.embed_tokens, GGUFEmbedding)  # the Q8_0 table, as stored
    packed_bytes = sum(b.numel() * b.element_size() for m in packed for b in m.buffers())
    weights = sum(m.in_features * m.out_features for m in packed)
    assert packed_bytes < 1.3 * weights  # about 0.6 bytes a weight (1.2 for the two-part Q8_0 head), not 4
    # The README's question, through the chat template: it went wrong with x rounded to bf16 once
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out[0].outputs[0].text
