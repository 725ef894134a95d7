"""GGUF K-quants (Q2_K .. Q6_K) and IQ4_NL / IQ4_XS kept packed on the CPU (``anygpu.quant.gguf_int4pack``,
``GGUFLinear``): the decoded codes rebuild ``gguf.quants.dequantize``'s weights, the packed product matches
``x @ W.T`` on them under the accuracy rule (bf16 compute), stacked projections of mixed types (llama.cpp's
Q4_K_M keeps v and down in Q6_K) run as segments, and tiny random Llamas of mixed types run through the engine
packed as they do with ``ANYGPU_CPU_GGUF_PACKED=0``.

Valid K-quant and IQ4 blocks are random bits with sized fp16 scales (``test_gguf_types._random_blocks``): gguf-py
decodes them but cannot encode them.
"""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from anygpu.quant import gguf_int4pack as P  # noqa: E402
from anygpu.quant.gguf_blocks import BLOCK_SHAPES  # noqa: E402
from anygpu.testing import assert_accurate  # noqa: E402

from .test_gguf_types import _random_blocks, _tensors, write_llama  # noqa: E402

pytestmark = pytest.mark.skipif(not P.supported(), reason="this torch has no CPU int4 matmul")

KQUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")  # the packed types gguf-py cannot encode


def _weight(name: str, n: int, k: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """Random valid blocks of an [n, k] weight and gguf-py's dequantization of them (fp32 [n, k])."""
    block, _ = BLOCK_SHAPES[name]
    blocks = _random_blocks(name, n * k // block, rng)
    dq = gguf.quants.dequantize(blocks.reshape(n, -1), QT[name]).reshape(n, k)
    return torch.from_numpy(blocks.reshape(-1).copy()), torch.from_numpy(dq.copy())


def _rebuild(c: P.Codes) -> torch.Tensor:
    """The weight the op computes with, in fp64 from the decoded codes (before any rounding to bf16)."""
    n = c.codes.shape[0]
    w = (c.codes.double().view(n, -1, P.GROUP) - 8) * c.scale.double().unsqueeze(-1) + c.zero.double().unsqueeze(-1)
    if c.layout is None:
        return w.reshape(n, -1)
    sub, f = c.layout
    w = w.reshape(n, -1, 2, sub)  # each run: its l codes' values, then its h codes' (whose x carries f)
    return (w[:, :, 0] + f * w[:, :, 1]).reshape(n, -1)


@pytest.mark.parametrize("name", P.TYPES)
def test_codes_rebuild_the_gguf_values(name):
    """Every packed type's codes, scales and zeros give gguf-py's weights (to fp32 rounding): any slip in a
    bit plane, a code offset or a scale's place shows here, apart from the op's bf16."""
    n, k = 48, 512
    raw, w = _weight(name, n, k, np.random.default_rng(sum(map(ord, name))))
    c = P.decode(raw, name, n, k)
    assert c.codes.dtype == torch.uint8 and int(c.codes.max()) <= 15
    assert c.codes.shape == (n, k if c.layout is None else 2 * k) and c.scale.shape == (n, c.codes.shape[1] // 32)
    torch.testing.assert_close(_rebuild(c), w.double(), atol=1e-6 * w.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("m,k", [(1, 256), (5, 512), (2, 1536)])
def test_kquant_product_matches_gguf_dequantized(name, m, k):
    rng = np.random.default_rng(m * k + len(name))
    rows = (80, 48, 16)  # none a multiple of 64
    raws, refs = zip(*(_weight(name, n, k, rng) for n in rows))
    order = torch.randperm(48, generator=torch.Generator().manual_seed(0))  # a row order, as for q/k heads
    parts = [P.decode(raws[0], name, 80, k), P.decode(raws[1], name, 48, k, order), P.decode(raws[2], name, 16, k)]
    w = torch.cat([refs[0], refs[1][order], refs[2]])
    segments = P.pack(parts)
    assert len(segments) == 1  # one type: one call
    x = torch.randn(m, k).bfloat16()
    ours = P.matmul(x, segments, w.shape[0])
    assert ours.dtype == torch.bfloat16 and ours.shape == (m, 144)
    assert_accurate(ours, x @ w.bfloat16().T, x.double() @ w.double().T, what=f"{name} m={m} k={k}")
    # fp32 x goes in as two bf16 halves: at least as accurate as bf16 (its products still round to bf16)
    x32 = torch.randn(m, k)
    y32 = P.matmul(x32, segments, w.shape[0])
    assert y32.dtype == torch.float32
    assert_accurate(y32.bfloat16(), x32.bfloat16() @ w.bfloat16().T, x32.double() @ w.double().T, what="fp32 x")


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q5_K", "Q8_0", "Q4_K"),
                                   ("Q5_K", "Q4_0", "Q6_K", "Q6_K")])
def test_mixed_types_stack_as_segments(types):
    """A fused projection of mixed types: adjacent tensors of one layout share a call, the outputs concatenate."""
    from anygpu.nn.linear_gguf import GGUFLinear

    k = 512
    rng = np.random.default_rng(len(types))
    rows = [64, 32, 48, 16][: len(types)]
    raws, refs = zip(*(_weight(t, n, k, rng) for t, n in zip(types, rows)))
    segments = P.pack([P.decode(r, t, n, k) for r, t, n in zip(raws, types, rows)])
    expected_rows = P.segment_rows(list(zip(types, rows)))
    assert [sz.shape[1] for _, sz, _ in segments] == expected_rows
    assert len(expected_rows) == len(types) - sum(P.LAYOUTS[a] == P.LAYOUTS[b] for a, b in zip(types, types[1:]))
    w = torch.cat(refs)
    bias = torch.randn(w.shape[0])
    layer = GGUFLinear(segments, k, w.shape[0], bias)
    x = torch.randn(3, 2, k).bfloat16()
    ours = layer(x)
    assert ours.shape == (3, 2, w.shape[0])
    assert_accurate(ours, x @ w.bfloat16().T + bias.bfloat16(), x.double() @ w.double().T + bias.double(),
                    what=f"{types}")
    with pytest.raises(ValueError, match="segments"):
        GGUFLinear(segments, k, w.shape[0] + 16)


# Tiny Llamas of mixed types: (base type, {tensor: type}, expected layouts of some packed layers)
MIXES = {
    # llama.cpp's Q4_K_M: v and down in Q6_K on some layers (use_more_bits), here layer 0; up of layer 1 in Q5_K
    "Q4_K_M": ("Q4_K", {"blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K", "output.weight": "Q6_K",
                        "blk.1.ffn_up.weight": "Q5_K"},
               {"layers.0.self_attn.qkv_proj": [None, (16, 8)], "layers.1.mlp.gate_up_proj": [None, (32, 16)],
                "layers.0.mlp.down_proj": [(16, 8)], "layers.1.self_attn.qkv_proj": [None]}),
    # the small types: Q3_K, with Q2_K and the IQ4s where llama.cpp's Q3_K / IQ mixes put other types
    "Q3_K_mix": ("Q3_K", {"blk.0.attn_v.weight": "IQ4_NL", "blk.0.ffn_down.weight": "Q2_K",
                          "blk.1.ffn_up.weight": "IQ4_XS"},
                 {"layers.0.self_attn.qkv_proj": [(16, 8), (32, 16)], "layers.1.mlp.gate_up_proj": [(16, 8), (32, 16)],
                  "layers.0.mlp.down_proj": [(16, 8)]}),
}


def _mixed_tensors(mix: str, seed: int) -> dict:
    """The tiny Llama of ``test_gguf_types`` in the mix's base type, with the mix's tensors in other types (the
    head, 258 rows, is no multiple of 16: it stays dequantized whatever its type)."""
    base, types, _ = MIXES[mix]
    out = _tensors(base, seed)
    for i, (name, qtype) in enumerate(types.items()):
        out[name] = _tensors(qtype, seed + 1 + i)[name]
    return out


class _Bf16Linear(torch.nn.Module):
    """torch's own bf16 product of a dequantized layer: the model-level yardstick of bf16 compute."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return torch.nn.functional.linear(x.bfloat16(), self.linear.weight.bfloat16()).float()


def _to_bf16(module: torch.nn.Module, packed: set[str], prefix: str = "") -> None:
    """Swap the layers named in ``packed`` for torch's bf16 product of the same dequantized weight."""
    for name, child in list(module.named_children()):
        if prefix + name in packed:
            setattr(module, name, _Bf16Linear(child))
        else:
            _to_bf16(child, packed, f"{prefix}{name}.")


@pytest.mark.parametrize("mix", MIXES)
def test_tiny_llama_mixed_kquants_packed_equals_dequantized(tmp_path, monkeypatch, mix):
    """Packed on against ``ANYGPU_CPU_GGUF_PACKED=0`` (fp32 on gguf's values): the same greedy tokens, and
    logits within 4x the error of torch's bf16 product on the same layers (a random model amplifies any
    rounding: bf16 alone moves its logits by about 2% of their largest; the packed layers' bf16 scales and
    zeros by up to 2.5 times that, as the per-layer accuracy rule allows)."""
    from anygpu.engine import LLMEngine
    from anygpu.nn.embedding_gguf import GGUFEmbedding
    from anygpu.nn.linear_gguf import GGUFLinear

    from .test_gguf_types import IDS
    from .test_models_llama import full_logits, greedy

    path = write_llama(tmp_path / f"tiny.{mix}.gguf", _mixed_tensors(mix, seed=21))
    results = {}
    for packed in ("1", "0"):
        monkeypatch.setenv("ANYGPU_CPU_GGUF_PACKED", packed)
        engine = LLMEngine(path, progress=False, block_size=4, max_model_len=64)
        model = engine.model
        layers = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
        if packed == "1":
            assert len(layers) == 4 * 2  # every projection; not the head: 258 rows, not a multiple of 16
            assert {name: layers[name].layouts for name in MIXES[mix][2]} == MIXES[mix][2]
            assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.type_name == MIXES[mix][0]
            packed_names = set(layers)
        else:
            assert not layers
        results[packed] = (greedy(engine, IDS[:8], 12), full_logits(model, IDS))
    _to_bf16(model, packed_names)
    bf16 = full_logits(model, IDS)
    (tokens, logits), (tokens_fp32, logits_fp32) = results["1"], results["0"]
    assert tokens == tokens_fp32
    err, bf16_err = ((y - logits_fp32).abs().max().item() for y in (logits, bf16))
    assert 0 < bf16_err < 0.05 * logits_fp32.abs().max().item()
    assert err < 4 * bf16_err, (err, bf16_err)
