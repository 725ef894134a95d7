"""``ModelRunner.pack`` builds the same message as the plain token-at-a-time packing it replaced, on every kind of
step a tiny random engine meets: plain prefills, decodes, chunked prefills mixed with decodes, prefix-cache hits,
one-token prompt chunks and prompt log-probabilities.  The reference below is that packing, kept as the spec."""

from __future__ import annotations

import torch

from anygpu.bench.model import random_engine, random_prompts
from anygpu.engine import SamplingParams
from anygpu.engine.model_runner import HEADER
from anygpu.models.llama import MODES


def reference_pack(batch, bs: int):
    ids, positions, slots, q_lens, k_lens, logit_rows, prompt_rows = [], [], [], [], [], [], []
    for i, (seq, n, needs_logits) in enumerate(zip(batch.seqs, batch.num_tokens, batch.needs_logits)):
        start = seq.num_computed_tokens
        if seq.needs_prompt_logprobs and start == len(seq.prompt_logprobs):
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            if count > 0:
                prompt_rows.append((i, len(ids), count))
        ids.extend(seq.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
        q_lens.append(n)
        k_lens.append(start + n)
        logit_rows.append(len(ids) - 1 if needs_logits else None)
    if all(n == 1 for n in q_lens):
        mode = "decode"
    elif all(s.num_computed_tokens == 0 for s in batch.seqs):
        mode = "prefill"
    else:
        mode = "mixed"
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    tables, width = [], 0
    if mode != "prefill":
        width = max(-(-k // bs) for k in k_lens)
        for seq in batch.seqs:
            row = seq.block_table[:width]
            tables += row + [0] * (width - len(row))
    rows = sorted({r for r in logit_rows if r is not None}.union(
        *(range(first, first + count) for _, first, count in prompt_rows)))
    header = [MODES.index(mode), len(ids), len(q_lens), width, max(q_lens), max(k_lens), len(rows), 0]
    if len(rows) == len(ids):
        rows = []
    return header + ids + positions + slots + cu + k_lens + tables + rows, logit_rows, prompt_rows


def checked(engine, seen: list):
    """Make every step's pack compare itself with the reference (and note the step's mode and prompt rows)."""
    runner = engine.runner
    pack = runner.pack

    def both(batch):
        message, logit_rows, prompt_rows = pack(batch)
        want = reference_pack(batch, runner.block_size)
        assert message.dtype == torch.long and message.dim() == 1
        assert (message.tolist(), logit_rows, prompt_rows) == want
        seen.append((MODES[want[0][0]], bool(prompt_rows)))
        return message, logit_rows, prompt_rows

    runner.pack = both
    return engine


def run(engine, prompts, params_of, stagger: int) -> dict[str, list[int]]:
    out, step, pending = {}, 0, list(enumerate(prompts))
    while pending or engine.has_unfinished():
        while pending and pending[0][0] * stagger <= step:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params_of(i))
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        step += 1
    return out


def test_pack_matches_reference_on_every_kind_of_step():
    seen = []
    # A small token budget chunks the prompts (mixed steps, one-token chunks where the budget runs out);
    # a small block size makes chunks cross block boundaries; shared prefixes make prefix-cache hits.
    engine = checked(random_engine("tiny", max_num_seqs=6, max_num_batched_tokens=37, block_size=4,
                                   max_model_len=160, progress=False), seen)
    base = random_prompts(8, 45, 1024, seed=3)
    prompts = [base[0][:30] + p[:11 + i] for i, p in enumerate(base)]  # 30 shared tokens, lengths 41-48
    greedy = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    with_prompt = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=2)
    out = run(engine, prompts, lambda i: with_prompt if i % 3 == 1 else greedy, stagger=2)
    assert sorted(out) == [str(i) for i in range(8)]
    modes = {m for m, _ in seen}
    assert modes == {"prefill", "decode", "mixed"}, modes
    assert any(p for _, p in seen)
    engine.close()


def test_pack_decode_batch_without_gather():
    seen = []
    engine = checked(random_engine("tiny", max_num_seqs=5, block_size=16, progress=False), seen)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    run(engine, random_prompts(5, 15, 1024, seed=4), lambda i: params, stagger=0)
    assert seen[0] == ("prefill", False) and seen.count(("decode", False)) == 19
    engine.close()


def test_decode_message_layout():
    """A decode step's message: HEADER, then one id, position and slot per sequence, no row indices."""
    engine = random_engine("tiny", max_num_seqs=3, block_size=4, progress=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), random_prompts(1, 6 + i, 1024, seed=5)[0], params)
    engine.step()
    batch = engine.scheduler.schedule()
    message, logit_rows, prompt_rows = engine.runner.pack(batch)
    m = message.tolist()
    assert m[:HEADER] == [MODES.index("decode"), 3, 3, 3, 1, 9, 3, 0]  # width: 9 tokens in blocks of 4
    body = m[HEADER:]
    assert body[0:3] == [s.last_token for s in batch.seqs]
    assert body[3:6] == [s.num_computed_tokens for s in batch.seqs] == [6, 7, 8]
    assert body[6:9] == [s.block_table[p // 4] * 4 + p % 4 for s, p in zip(batch.seqs, (6, 7, 8))]
    assert len(body) == 3 * 3 + 4 + 3 + 3 * 3 and logit_rows == [0, 1, 2] and prompt_rows == []
    engine.close()


def test_pack_matches_reference_through_preemptions():
    """Preempted sequences lose their tables and come back with new ones: pack's kept copies must follow."""
    seen, preempted = [], []
    engine = checked(random_engine("tiny", max_num_seqs=4, block_size=4, max_model_len=64, num_kv_blocks=24,
                                   progress=False), seen)
    schedule = engine.scheduler.schedule

    def noting():
        batch = schedule()
        preempted.extend(s.seq_id for s in batch.preempted)
        return batch

    engine.scheduler.schedule = noting
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    out = run(engine, random_prompts(4, 20, 1024, seed=6), lambda i: params, stagger=1)
    assert sorted(out) == ["0", "1", "2", "3"] and all(len(t) == 30 for t in out.values())
    assert preempted and "decode" in {m for m, _ in seen}
    engine.close()
