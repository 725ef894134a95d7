"""The sampler's all-greedy shortcut gives the tokens of its general path: the same batch through the general path
(forced by asking for log-probabilities, which do not change the token) must pick the same ids, ties and all."""

import pytest
import torch

from anygpu.engine import Sampler, SamplingParams, Sequence
from anygpu.engine.sampler import _plain_greedy


def seq(**params):
    return Sequence([1, 2, 3], SamplingParams(**params))


def tied_logits(rows: int, vocab: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).to(dtype)  # few values: ties for the top in most rows
    logits[0] = float("-inf")
    logits[0, vocab - 1] = 0.0
    logits[1, 5] = float("nan")  # argmax takes NaN as the largest, in either path
    return logits


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_shortcut_matches_the_general_path(rows, dtype):
    logits = tied_logits(max(rows, 2), 257, dtype)[:rows]
    fast = [seq(temperature=0.0) for _ in range(rows)]
    general = [seq(temperature=0.0, logprobs=0) for _ in range(rows)]
    assert _plain_greedy(fast) and not _plain_greedy(general)
    sampler = Sampler()
    got = sampler.sample_each(logits, fast)
    assert got == sampler.sample_each(logits, general) == logits.float().argmax(-1).tolist()
    assert all(s.output_logprobs == [] for s in fast) and all(len(s.output_logprobs) == 1 for s in general)


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                                    dict(frequency_penalty=-0.5), dict(logprobs=2)])
def test_one_row_that_needs_more_than_argmax_takes_the_general_path(params):
    seqs = [seq(temperature=0.0) for _ in range(5)]
    seqs[3] = seq(**{"temperature": 0.0, **params})
    assert not _plain_greedy(seqs)
    logits = torch.randn(5, 50)
    logits[3, 2] = 30.0  # a prompt token: a repetition penalty of 1.2 leaves it on top
    got = Sampler().sample(logits, seqs)
    assert [got[i] for i in (0, 1, 2, 4)] == [logits[i].argmax().item() for i in (0, 1, 2, 4)]
    assert got[3] == 2 or params.get("temperature", 0) > 0
    assert len(seqs[3].output_logprobs) == (1 if "logprobs" in params else 0)


def test_a_guided_row_is_not_plain_greedy():
    s = seq(temperature=0.0)
    assert _plain_greedy([s])
    s.guide = object()  # any grammar: the sampler must mask its logits
    assert not _plain_greedy([s])


def test_shortcut_still_checks_the_shape():
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, 10), [seq(temperature=0.0)])
