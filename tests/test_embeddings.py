"""Embedding, StableEmbedding, Embedding8bit, Embedding4bit / NF4 / FP4 against bitsandbytes' own modules on the
CPU (same source weights, same indices: the outputs must be identical) and against the full-precision lookup
(within the format's rounding)."""

import pytest
import torch

import anygpu.nn as ann
import anygpu.optim as ao

bnb = pytest.importorskip("bitsandbytes")

QUANTIZED = ["EmbeddingNF4", "EmbeddingFP4", "Embedding8bit"]


@pytest.fixture(autouse=True)
def _fresh_manager():
    ao.GlobalOptimManager.get_instance().initialize()
    yield
    ao.GlobalOptimManager.get_instance().initialize()


def _pair(name, num=100, dim=128, dtype=None, seed=0):
    torch.manual_seed(seed)
    src = torch.nn.Embedding(num, dim, dtype=dtype)
    ours, theirs = getattr(ann, name)(num, dim, dtype=dtype), getattr(bnb.nn, name)(num, dim, dtype=dtype)
    ours.load_state_dict(src.state_dict())
    theirs.load_state_dict(src.state_dict())
    return src, ours.to("cpu"), theirs.to("cpu")


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_embeddings_equal_bitsandbytes_cpu(name, dtype):
    src, ours, theirs = _pair(name, dtype=dtype)
    idx = torch.randint(0, 100, (3, 7))
    out = ours(idx)
    assert out.shape == (3, 7, 128) and out.dtype == dtype
    torch.testing.assert_close(out, theirs(idx), rtol=0, atol=0)
    # within the format's rounding of the source rows (4-bit: half the widest NF4 / FP4 gap of the row max)
    rows = src(idx).float()
    bound = rows.abs().amax(-1, keepdim=True) * (0.01 if name == "Embedding8bit" else 0.26)
    assert ((out.float() - rows).abs() <= bound).all()


@pytest.mark.parametrize("name", ["EmbeddingNF4", "EmbeddingFP4"])
def test_4bit_rows_not_whole_blocks_dequantize_the_table(name):
    with pytest.warns(UserWarning, match="blocksize"):
        _, ours, theirs = _pair(name, num=30, dim=100)
    idx = torch.tensor([[0, 29, 5]])
    torch.testing.assert_close(ours(idx), theirs(idx), rtol=0, atol=0)


def test_quantized_on_first_forward_without_a_move():
    torch.manual_seed(0)
    layer = ann.EmbeddingNF4(10, 64)
    assert layer.weight.quant_state is None
    layer(torch.tensor([1, 2]))
    assert layer.weight.quant_state is not None and layer.weight.dtype == torch.uint8


@pytest.mark.parametrize("name", QUANTIZED)
def test_saving_is_refused_as_in_bitsandbytes(name):
    with pytest.raises(NotImplementedError, match="saving"):
        getattr(ann, name)(10, 64).state_dict()


def test_stable_embedding_equals_bitsandbytes_and_gets_32bit_states():
    torch.manual_seed(0)
    ours = ann.StableEmbedding(50, 64)
    theirs = bnb.nn.StableEmbedding(50, 64)
    theirs.load_state_dict(ours.state_dict())
    idx = torch.randint(0, 50, (4, 9))
    torch.testing.assert_close(ours(idx), theirs(idx), rtol=0, atol=0)
    model = torch.nn.Sequential(ours, torch.nn.Linear(64, 80))
    opt = ao.Adam(model.parameters(), optim_bits=8)
    model(idx).sum().backward()
    opt.step()
    assert opt.state[ours.weight]["state1"].dtype == torch.float32  # the registered override
    assert opt.state[model[1].weight]["state1"].dtype == torch.uint8


def test_embedding_is_xavier_initialised_with_a_zero_padding_row():
    torch.manual_seed(0)
    layer = ann.Embedding(1000, 64, padding_idx=3)
    assert torch.equal(layer.weight[3], torch.zeros(64))
    limit = (6 / (1000 + 64)) ** 0.5
    assert layer.weight.abs().max() <= limit and layer.weight.abs().max() > 0.9 * limit
