"""``Sampler``: the next token of each sequence from its logits row, under its SamplingParams.

Order (vLLM's, with HF's processor order for the filters):

1. penalties on the raw logits: repetition over prompt + output tokens (a seen token's logit is divided by
   the penalty when positive, multiplied when negative: HF/vLLM), then frequency (times the token's count in
   the output) and presence (once if it occurs in the output) subtracted (OpenAI);
2. greedy rows (temperature < 1e-5, vLLM's epsilon) take the argmax of the penalized logits;
3. the other rows: divide by the temperature; keep the top-k, then the smallest prefix of the sorted
   distribution whose mass reaches top-p (the most likely token always stays), then the tokens whose
   probability is at least min-p times the largest one (min-p compares ratios, which renormalizing after
   top-k/top-p does not change, so it is done in log space on the sorted logits);
4. sample with the exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)`` iid, which draws index i with
   probability probs[i] (nano-vllm's and vLLM's method: one vectorised kernel, no cumulative sums).

Seeded requests draw their row's q from their own ``torch.Generator`` (``seq.generator``, made on first use
and seeded with ``params.seed``), so a seed gives the same tokens whether the sequence is sampled alone or in
any batch, and across preemptions.  Unseeded rows use the global RNG.  Rows are independent: the sort,
softmax and cumulative sums work along the vocabulary only.

Penalties and filters are vectorised over the batch (token counts by scatter, filters by one sort) and
skipped when no row uses them.  A guided row's (``guided.py``) disallowed tokens are set to -inf after the
penalties, so greedy, filters and sampling only ever see what its grammar allows.  Works on any device; logits
are read as fp32 and never modified.

A batch of plain greedy rows (``_plain_greedy``) gets the argmax of its logits, in one read back; a decode graph
computes that argmax with the logits (``greedy``: model_runner.py), and then only the ids are read back.

One request cannot fail the others: ``sample_each`` samples the batch, and if that raises, samples each row
alone, so only the rows that fail alone get their exception (the engine fails those requests and steps on).
The seeded generators are put back to where they were before the failed batch, so a seeded request draws
the same tokens whether or not a neighbour failed.  Values are bounded before they reach torch: a seed is
masked to the 64 bits torch takes, a top-k above the vocabulary means "keep all".
"""

from __future__ import annotations

import math

import torch

from .guided import mask_logits
from .sequence import Sequence

SAMPLING_EPS = 1e-5  # temperatures below this are greedy
PROMPT_ROWS_AT_ONCE = 256
SEED_MASK = 2**64 - 1  # torch seeds are 64-bit: a negative seed becomes its two's complement, as torch reads it


def _device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small tensor of per-row values on ``device``.  On a GPU through pinned memory and a non-blocking copy: a
    plain ``torch.tensor(..., device=cuda)`` waits for the device to finish its queue, which a step launched ahead
    (``ModelRunner.launch``) must never do."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def _token_index(lists: list[list[int]], rows: list[int], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs, one per occurrence, for a scatter into a [B, V] table; ids outside the vocab dropped."""
    ids = torch.tensor([t for toks in lists for t in toks], dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long),
                                  torch.tensor([len(toks) for toks in lists], dtype=torch.long))
    ok = (ids >= 0) & (ids < vocab)
    return row[ok].to(device), ids[ok].to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The logits with each row's repetition, frequency and presence penalties applied (a new tensor)."""
    batch, vocab = logits.shape
    device = logits.device
    rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    out = [i for i, s in enumerate(seqs) if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0]
    if rep:
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        seen[_token_index([seqs[i].token_ids for i in rep], rep, vocab, device)] = True
        penalty = torch.tensor([s.params.repetition_penalty for s in seqs], device=device).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if out:
        counts = torch.zeros(batch, vocab, device=device)
        index = _token_index([seqs[i].output_token_ids for i in out], out, vocab, device)
        counts.index_put_(index, torch.ones(index[0].shape, device=device), accumulate=True)
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=device).unsqueeze(1)
        presence = torch.tensor([s.params.presence_penalty for s in seqs], device=device).unsqueeze(1)
        logits = logits - freq * counts - presence * (counts > 0)
    return logits


def apply_filters(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Logits with the tokens outside each row's top-k / top-p / min-p set at -inf (top_k <= 0: off)."""
    rows, vocab = logits.shape
    k = [min(v, vocab) if v > 0 else vocab for v in top_k]  # bounded before torch.tensor, which takes int64
    if all(v >= vocab for v in k) and all(p >= 1.0 for p in top_p) and all(m <= 0.0 for m in min_p):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # ties: lowest id first, as argmax
    keep = torch.arange(vocab, device=device) < _device_tensor(k, device).unsqueeze(1)
    if any(p < 1.0 for p in top_p):
        probs = sorted_logits.masked_fill(~keep, -math.inf).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        limit = _device_tensor([p if p < 1.0 else math.inf for p in top_p], device).unsqueeze(1)
        keep &= mass_before < limit
    if any(m > 0.0 for m in min_p):
        log_min_p = _device_tensor(min_p, device).log().unsqueeze(1)  # log 0 = -inf keeps all
        keep &= (sorted_logits - sorted_logits[:, :1]) >= log_min_p
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(~keep, -math.inf))


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[int], ks: list[int]) -> list[tuple]:
    """Each row's (logprob of its token, its rank, the k most likely (id, logprob)), from the model's raw
    logits (vLLM's default: before penalties, temperature and filters, so they describe the model)."""
    index = torch.tensor(rows, device=raw.device)
    lp = torch.log_softmax(raw[index], dim=-1)
    chosen = lp.gather(1, tokens[index].unsqueeze(1))
    ranks = (lp > chosen).sum(dim=1) + 1
    top_lp, top_ids = lp.topk(max(ks), dim=-1) if max(ks) else (lp[:, :0], lp[:, :0].long())
    chosen, ranks, top_lp, top_ids = chosen[:, 0].tolist(), ranks.tolist(), top_lp.tolist(), top_ids.tolist()
    return [(chosen[j], ranks[j], list(zip(top_ids[j][:k], top_lp[j][:k]))) for j, k in enumerate(ks)]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[tuple]:
    """Prompt positions' entries, as ``_logprobs``'s: row i of ``logits`` (the raw logits of one position) scored
    against ``targets[i]`` (the prompt token that follows it)."""
    entries = []
    for start in range(0, len(targets), PROMPT_ROWS_AT_ONCE):  # a bounded number of [rows, vocab] copies at once
        rows = logits[start:start + PROMPT_ROWS_AT_ONCE].float()
        tokens = torch.tensor(targets[start:start + PROMPT_ROWS_AT_ONCE], device=logits.device)
        entries += _logprobs(rows, tokens, list(range(rows.shape[0])), [k] * rows.shape[0])
    return entries


def samples_without_history(seqs: list[Sequence]) -> bool:
    """No row's token depends on anything but its logits, its parameters and its own generator: no penalty (the
    tokens so far), no grammar (its state), no log-probabilities (read back).  Such a batch is sampled entirely
    on the device (``Sampler.sample_tensor``), so a step can be launched before the last one's tokens are read."""
    for s in seqs:
        p = s.params
        if (p.logprobs is not None or s.guide is not None or p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            return False
    return True


def _plain_greedy(seqs: list[Sequence]) -> bool:
    """Every row greedy with nothing that changes its logits or asks for more than the token: no penalty, no
    grammar, no log-probabilities.  The general path gives such a batch the argmax of its raw logits."""
    return samples_without_history(seqs) and all(s.params.temperature < SAMPLING_EPS for s in seqs)


class Sampler:
    def sample_each(self, logits: torch.Tensor, seqs: list[Sequence],
                    greedy: torch.Tensor | None = None) -> list[int | Exception]:
        """``sample``, except that a row whose sampling fails gets its exception instead of a token, and the
        other rows still get theirs (the batch is retried row by row, from the logits, only after a failure)."""
        states = generator_states(seqs)
        try:
            return list(self.sample(logits, seqs, greedy))
        except Exception:
            pass
        restore_generators(seqs, states)
        results: list[int | Exception] = []
        for i, seq in enumerate(seqs):
            try:
                results.append(self.sample(logits[i:i + 1], [seq])[0])
            except Exception as error:
                results.append(error)
        return results

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None = None) -> list[int]:
        """One token per row: logits [B, V] (read as fp32) for seqs[0..B-1].  ``greedy``: ``logits.argmax(-1)``
        already computed (a decode graph's), used when every row is plainly greedy."""
        return self.sample_tensor(logits, seqs, greedy).tolist()

    def sample_tensor(self, logits: torch.Tensor, seqs: list[Sequence],
                      greedy: torch.Tensor | None = None) -> torch.Tensor:
        """``sample``'s tokens as a tensor on the logits' device [B] (int64), read back by no one: a GPU runs it
        without waiting, except for penalties (their token tables) and log-probabilities (their entries)."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits: expected shape [{len(seqs)}, vocab] (one row per sequence), "
                             f"got {tuple(logits.shape)}")
        if _plain_greedy(seqs):  # the usual batch: one argmax (what the general path gives)
            if greedy is not None:
                if greedy.shape != (len(seqs),):
                    raise ValueError(f"greedy: expected shape [{len(seqs)}] (one id per sequence), "
                                     f"got {tuple(greedy.shape)}")
                return greedy
            return logits.float().argmax(dim=-1)
        raw = logits.float()
        # Guided rows (structured output) sample only what their grammar allows next: greedy and sampled alike.
        logits = mask_logits(apply_penalties(raw, seqs), seqs)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if s.params.temperature >= SAMPLING_EPS]
        if rows:
            params = [seqs[i].params for i in rows]
            device = logits.device
            index = _device_tensor(rows, device)
            temperature = _device_tensor([p.temperature for p in params], device).unsqueeze(1)
            x = apply_filters(logits[index] / temperature, [p.top_k for p in params],
                              [p.top_p for p in params], [p.min_p for p in params])
            probs = x.softmax(dim=-1)
            q = torch.empty_like(probs).exponential_()
            for j, i in enumerate(rows):
                if seqs[i].params.seed is not None:
                    q[j] = self._draw(seqs[i], probs.shape[1], device)
            tokens[index] = (probs / q.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        entries = _logprobs(raw, tokens, wanted, [seqs[i].params.logprobs for i in wanted]) if wanted else []
        for i, entry in zip(wanted, entries):  # last: nothing after this can fail and leave a stray entry
            seqs[i].output_logprobs.append(entry)
        return tokens

    @staticmethod
    def _draw(seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
        """Exp(1) draws for seq's row from its own generator, made on the first draw on the logits' device
        (and kept there: a later call on another device draws there and copies, never reseeds)."""
        if seq.generator is None:
            seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed & SEED_MASK)
        draws = torch.empty(vocab, device=seq.generator.device).exponential_(generator=seq.generator)
        return draws.to(device)


def generator_states(seqs: list[Sequence]) -> list:
    """The seeded rows' generator states, for ``restore_generators`` after a batch that failed."""
    return [(s, s.generator.get_state()) for s in seqs if s.generator is not None]


def restore_generators(seqs: list[Sequence], states: list) -> None:
    """Back to the generators' states before a failed batch: rows before the failing one may have drawn, and rows
    that had no generator may have made one (so a seeded request draws the same tokens whether or not a
    neighbour failed)."""
    for seq, state in states:
        seq.generator.set_state(state)
    had = {id(seq) for seq, _ in states}
    for seq in seqs:
        if id(seq) not in had:
            seq.generator = None
