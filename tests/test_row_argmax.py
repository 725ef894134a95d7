"""``engine.row_argmax``: the decode graph's greedy tokens in two passes, the same indices as ``argmax(-1)``."""

import pytest
import torch

from anygpu.engine.row_argmax import MIN_VOCAB, chunks_for, row_argmax


def test_chunks_follow_the_measured_lengths():
    assert chunks_for(1, 128256) == 167  # 768-long chunks at batch 1 (Llama 3)
    assert chunks_for(64, 128256) == 64  # 2004-long chunks for batches
    assert chunks_for(1, 151936) == 128  # Qwen 2.5: 2^7 * 1187, the nearest divisor in range
    assert chunks_for(1, 49152) == 1  # small vocabularies keep argmax
    assert chunks_for(1, MIN_VOCAB + 1) == 1  # 65537 is prime: no divisor in range
    for rows, vocab in ((1, 128256), (8, 256000), (64, 200064)):
        s = chunks_for(rows, vocab)
        assert vocab % s == 0 and 32 <= s <= 512


def _cases(rows: int, vocab: int, width: int):
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    plain = torch.randn(rows, vocab, generator=g)
    yield "plain", plain
    ties = plain.clone()  # the row's maximum three times: in one chunk, and in a later chunk
    top = ties.max() + 1
    ties[:, width + 3] = top
    ties[:, width + 9] = top
    ties[:, vocab - 5] = top
    yield "ties", ties
    same = torch.zeros(rows, vocab)  # every value equal: index 0
    yield "all equal", same
    nan = plain.clone()  # NaN wins over +inf, the first NaN over later ones (in its chunk and in later chunks)
    nan[:, 2 * width + 1] = float("inf")
    nan[:, 3 * width + 7] = float("nan")
    nan[:, 3 * width + 2] = float("nan")
    nan[:, vocab - 1] = float("nan")
    yield "nan", nan
    neg = torch.full((rows, vocab), float("-inf"))
    yield "-inf rows", neg
    mixed = plain.clone()
    mixed[0] = float("-inf")
    mixed[-1, vocab // 2] = float("inf")
    yield "mixed rows", mixed


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (3, 128256), (64, 131072), (2, 151936)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_indices_as_argmax(rows, vocab, dtype):
    s = chunks_for(rows, vocab)
    assert s > 1
    for name, logits in _cases(rows, vocab, vocab // s):
        logits = logits.to(dtype)
        got = row_argmax(logits)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got, logits.argmax(dim=-1)), name


def test_unsplit_shapes_and_views():
    x = torch.randn(2, 1000)
    assert torch.equal(row_argmax(x), x.argmax(-1))
    wide = torch.randn(2, 2 * 128256)[:, :128256]  # not contiguous: argmax as is
    assert torch.equal(row_argmax(wide), wide.argmax(-1))
    with pytest.raises(ValueError, match="logits"):
        row_argmax(torch.randn(128256))
