"""Sampler: greedy, penalties and filters against small hand-written references, seeds, the sampled distribution."""

import math

import pytest
import torch

from anygpu.engine import Sampler, SamplingParams, Sequence
from anygpu.engine.sampler import apply_filters, apply_penalties

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def seq(prompt=(1, 2, 3), output=(), **params):
    s = Sequence(list(prompt), SamplingParams(**params))
    s.output_token_ids = list(output)
    return s


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_top_k_1_or_tiny_top_p_too(device):
    logits = torch.randn(6, 40, device=device)
    logits[5, 7] = logits[5, 30] = logits[5].max() + 1  # a tie: the lowest id, as argmax
    expect = logits.argmax(-1).tolist()
    sampler = Sampler()
    assert sampler.sample(logits, [seq(temperature=0.0) for _ in range(6)]) == expect
    for _ in range(5):
        assert sampler.sample(logits, [seq(temperature=1.5, top_k=1) for _ in range(6)]) == expect
        assert sampler.sample(logits, [seq(temperature=1.0, top_p=1e-6) for _ in range(6)]) == expect
        got = sampler.sample(logits, [seq(temperature=2.0, min_p=1.0) for _ in range(6)])
        assert got[:5] == expect[:5] and got[5] in (7, 30)  # min_p = 1 keeps every token tied for the top


def reference_penalties(row: list[float], s: Sequence) -> list[float]:
    p = s.params
    row = list(row)
    for t in set(s.prompt_token_ids + s.output_token_ids):
        if 0 <= t < len(row):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        if 0 <= t < len(row):
            row[t] -= p.frequency_penalty * s.output_token_ids.count(t) + p.presence_penalty
    return row


def test_penalties_match_the_reference():
    seqs = [
        seq(prompt=[1, 2, 2, 3], output=[3, 4, 4, 4], repetition_penalty=1.5),
        seq(prompt=[5, 6], output=[6, 7, 7], frequency_penalty=0.5, presence_penalty=-1.0),
        seq(prompt=[0, 1], output=[1, 9, 9], repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=2),
        seq(prompt=[1, 2], output=[2, 2]),                     # no penalties: untouched
        seq(prompt=[3, 99], output=[123], repetition_penalty=2.0, presence_penalty=1.0),  # ids past the vocab
    ]
    logits = torch.randn(len(seqs), 12)
    logits[0, 3], logits[0, 4] = 2.0, -2.0  # a positive and a negative repeated logit
    got = apply_penalties(logits.clone(), seqs)
    expect = torch.tensor([reference_penalties(logits[i].tolist(), s) for i, s in enumerate(seqs)])
    torch.testing.assert_close(got, expect)
    assert got[0, 3] == 2.0 / 1.5 and got[0, 4] == -2.0 * 1.5
    assert torch.equal(got[3], logits[3])


def reference_keep(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens kept, by the definitions: top-k, then the smallest set with mass >= top_p, then min-p."""
    order = sorted(range(len(row)), key=lambda i: (-row[i].item(), i))
    if top_k > 0:
        order = order[:top_k]
    probs = torch.softmax(row[order], -1).tolist()
    kept, mass = [], 0.0
    for i, p in zip(order, probs):
        if mass >= top_p:
            break
        kept.append(i)
        mass += p
    pmax = probs[0]
    return {i for i, p in zip(order, probs) if i in kept and p >= min_p * pmax}


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (8, 0.9, 0.05),
                                               (-1, 0.3, 0.5), (3, 0.999, 0.0)])
def test_filters_keep_the_reference_set(top_k, top_p, min_p):
    logits = torch.randn(4, 30) * 2
    out = apply_filters(logits, [top_k] * 4, [top_p] * 4, [min_p] * 4)
    for r in range(4):
        kept = set(torch.nonzero(out[r] > -math.inf).flatten().tolist())
        assert kept == reference_keep(logits[r], top_k, top_p, min_p)
        assert torch.equal(out[r][list(kept)], logits[r][list(kept)])


def test_min_p_never_samples_a_filtered_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    s = seq(temperature=1.0, min_p=0.15, seed=3)  # keeps p >= 0.075: tokens 0, 1, 2
    drawn = {Sampler().sample(logits, [s])[0] for _ in range(300)}
    assert drawn == {0, 1, 2}


@pytest.mark.parametrize("device", DEVICES)
def test_a_seed_gives_the_same_tokens_alone_or_in_a_batch(device):
    steps, vocab = 12, 64
    rows = torch.randn(steps, vocab, device=device)
    params = dict(temperature=0.9, top_k=40, top_p=0.95, seed=1234, repetition_penalty=1.1)
    sampler = Sampler()
    lone = seq(**params)
    alone = [sampler.sample(rows[i:i + 1], [lone])[0] for i in range(steps)]
    twin = seq(**params)
    others = [seq(temperature=1.0), seq(temperature=0.7, seed=99), seq(temperature=0.0)]
    batched = []
    for i in range(steps):
        position = i % 4  # the seeded row moves around the batch
        batch = others[:position] + [twin] + others[position:]
        logits = torch.randn(4, vocab, device=device)
        logits[position] = rows[i]
        batched.append(sampler.sample(logits, batch)[position])
    assert batched == alone
    assert len(set(alone)) > 1  # really sampled
    assert [sampler.sample(rows[i:i + 1], [seq(**params)])[0] for i in range(1)] == alone[:1]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.6, 0), (1.7, 4)])
def test_sampled_distribution_matches_the_softmax(temperature, top_k):
    torch.manual_seed(1)
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])
    n, rounds = 4000, 5
    params = SamplingParams(temperature=temperature, top_k=top_k)
    seqs = [Sequence([1], params) for _ in range(n)]
    counts = torch.zeros(6)
    for _ in range(rounds):
        tokens = Sampler().sample(logits.expand(n, 6), seqs)
        counts += torch.bincount(torch.tensor(tokens), minlength=6).float()
    scaled = logits / temperature
    if top_k:
        scaled[scaled < scaled.topk(top_k).values[-1]] = -math.inf
    probs = scaled.softmax(-1)
    support = probs > 0
    assert counts[~support].sum() == 0
    # 5 (or 3) degrees of freedom: the 0.1 % critical value is 20.5; a wrong temperature gives hundreds.
    assert chi_square(counts[support], probs[support]) < 25


def test_bad_logits_shape_raises():
    with pytest.raises(ValueError, match="logits: expected shape \\[2, vocab\\]"):
        Sampler().sample(torch.zeros(3, 5), [seq(), seq()])


class FaultyDraw(Sampler):
    """Fails the draw of one sequence: after the rows before it in the batch have drawn from their generators."""

    def __init__(self, bad):
        self.bad = bad

    def _draw(self, s, vocab, device):
        if s is self.bad:
            raise RuntimeError("injected: draw failed")
        return Sampler._draw(s, vocab, device)


def test_sample_each_fails_only_the_failing_row_and_keeps_the_seeds_in_step():
    logits = torch.randn(3, 50)
    clean = [seq(temperature=1.0, seed=7), seq(temperature=0.0), seq(temperature=1.0, seed=8)]
    expect = [Sampler().sample(logits, clean) for _ in range(4)]
    rows = [seq(temperature=1.0, seed=7), seq(temperature=0.0), seq(temperature=1.0, seed=8)]
    sampler = FaultyDraw(rows[2])
    for step in range(4):
        got = sampler.sample_each(logits, rows)
        # Row 0 drew before row 2 failed: its generator is put back, so it draws what it would have.
        assert got[:2] == expect[step][:2] and isinstance(got[2], RuntimeError), step


def test_out_of_range_values_cannot_overflow_the_sampler():
    """Values SamplingParams refuses, set behind its back: the sampler still bounds them before torch sees them
    (a seed is masked to 64 bits as torch reads it, a top-k above the vocabulary keeps all)."""
    logits = torch.randn(1, 64)
    signed, unsigned, huge = seq(temperature=1.0, seed=-1), seq(temperature=1.0, seed=2**64 - 1), seq(temperature=1.0)
    assert [Sampler().sample(logits, [signed])[0] for _ in range(5)] == \
           [Sampler().sample(logits, [unsigned])[0] for _ in range(5)]
    signed.params.seed = 2**64 + 5
    assert isinstance(Sampler().sample(logits, [signed])[0], int)
    huge.params.top_k, huge.params.top_p = 2**63, 0.9
    keep_all = apply_filters(logits, [2**63], [1.0], [0.0])
    assert torch.equal(keep_all, logits)
    assert isinstance(Sampler().sample(logits, [huge])[0], int)
