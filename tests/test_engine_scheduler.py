"""Scheduler: decode-first order, chunked prefill in the token budget, preemption by recomputation, no deadlock.

A fake model stands in for the real one: it writes each computed token into a fake KV cache (one slot per
block row, as the real cache) and derives the next token from what the cache holds for the sequence's
positions.  A block shared by mistake, a prefix hit on the wrong block or a lost chunk therefore changes the
token stream, which is compared with the same sequence run alone.
"""

import random

import pytest

from anygpu.engine import BlockManager, SamplingParams, Scheduler, Sequence, SequenceStatus

VOCAB = 50
EOS = 0


def next_token(context: list) -> int:
    h = 17
    for t in context:
        h = (h * 1000003 + (-1 if t is None else t)) % 2_147_483_647
    return h % VOCAB


class FakeModel:
    def __init__(self, block_size: int):
        self.bs = block_size
        self.cache = {}

    def slot(self, seq, pos):
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def __call__(self, batch):
        for seq, n in zip(batch.seqs, batch.num_tokens):  # write all the step's K/V, then read
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.cache[self.slot(seq, pos)] = seq.token_ids[pos]
        return [next_token([self.cache.get(self.slot(s, p)) for p in range(s.num_tokens)]) if last else None
                for s, last in zip(batch.seqs, batch.needs_logits)]


def check_invariants(sched, batch):
    bm = sched.block_manager
    assert 0 < batch.total_tokens <= sched.max_num_batched_tokens or not batch.seqs
    assert len(batch.seqs) <= sched.max_num_seqs and len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
    chunked = False
    for seq, n in zip(batch.seqs, batch.num_tokens):
        assert seq.status is SequenceStatus.RUNNING and n >= 1
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
        chunked |= seq.num_computed_tokens + n < seq.num_tokens
    if chunked:  # a prefill is cut only where the budget ends
        assert batch.total_tokens == sched.max_num_batched_tokens
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        for block in seq.block_table:
            refs[block] += 1
    assert refs == bm.ref_counts
    assert bm.num_free_blocks == refs.count(0)
    assert all(not s.block_table for s in sched.waiting)


def drive(sched, max_steps=5000, on_step=None):
    """Run to completion; returns the finished sequences in finishing order."""
    model = sched.fake_model
    finished = []
    for _ in range(max_steps):
        if not sched.has_work():
            return finished
        batch = sched.schedule()
        check_invariants(sched, batch)
        if on_step:
            on_step(batch)
        finished += sched.update(batch, model(batch))
    raise AssertionError("the scheduler did not finish: deadlock or livelock")


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=64, eos=(EOS,)):
    sched = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_model_len, eos_token_ids=eos)
    sched.fake_model = FakeModel(block_size)  # one cache for the scheduler's life: prefix hits read it
    return sched


def alone(seq, **config):
    """seq's (output, finish reason) when it is the only request."""
    twin = Sequence(seq.prompt_token_ids, seq.params)
    sched = make(**config)
    sched.add(twin)
    drive(sched)
    return twin.output_token_ids, twin.finish_reason


def test_decode_first_then_partial_prefills_then_waiting():
    sched = make(budget=10)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    a, b, c, d = (Sequence(range(100 * i, 100 * i + n), params) for i, n in enumerate((3, 3, 20, 5)))
    model = sched.fake_model
    steps = []

    def step():
        batch = sched.schedule()
        check_invariants(sched, batch)
        steps.append([(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_tokens)])
        sched.update(batch, model(batch))

    sched.add(a), sched.add(b)
    step()
    sched.add(c), sched.add(d)
    for _ in range(3):
        step()
    A, B, C, D = (s.seq_id for s in (a, b, c, d))
    assert steps == [[(A, 3), (B, 3)], [(A, 1), (B, 1), (C, 8)], [(A, 1), (B, 1), (C, 8)],
                     [(A, 1), (B, 1), (C, 4), (D, 4)]]
    assert c.num_output_tokens == 1 and d.num_output_tokens == 0 and d.num_computed_tokens == 4


def test_prefix_hit_skips_the_cached_blocks():
    sched = make()
    prompt = list(range(1, 11))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = Sequence(prompt, params)
    sched.add(first)
    drive(sched)
    second = Sequence(prompt, params)
    sched.add(second)
    batch = sched.schedule()
    assert batch.num_tokens == [2] and second.num_cached_tokens == 8
    sched.update(batch, sched.fake_model(batch))
    assert drive(sched) == [second]
    assert second.output_token_ids == first.output_token_ids


def test_preemption_by_recomputation_keeps_the_output_and_completes():
    config = dict(num_blocks=6, block_size=2, budget=16)
    sched = make(**config)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b = Sequence([1, 2, 3, 4], params), Sequence([5, 6, 7, 8], params)
    c = Sequence([9, 10, 11, 12, 13, 14], params)  # arrives later, waits for blocks
    sched.add(a), sched.add(b)
    seen = []

    def on_step(batch):
        if c.status is SequenceStatus.WAITING and c not in sched.waiting:
            sched.add(c)
        if batch.preempted:
            assert batch.preempted == [b] and b not in batch.seqs
            assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
            assert b.num_output_tokens > 0 and list(sched.waiting) == [b, c]  # b goes first
            seen.append(b.num_output_tokens)

    assert drive(sched, on_step=on_step) == [a, b, c]
    assert seen and b.num_preemptions == len(seen) and a.num_preemptions == c.num_preemptions == 0
    for s in (a, b, c):
        assert s.num_output_tokens == 6 and s.finish_reason == "length"
        assert (s.output_token_ids, s.finish_reason) == alone(s, **config)


@pytest.mark.parametrize("num_blocks,max_model_len", [(8, 16), (6, 24)])
def test_no_deadlock_with_a_tiny_pool_and_many_long_sequences(num_blocks, max_model_len):
    rng = random.Random(num_blocks)
    config = dict(num_blocks=num_blocks, block_size=2, max_num_seqs=4, budget=5, max_model_len=max_model_len)
    sched = make(**config)
    seqs = []
    for i in range(16):
        params = SamplingParams(max_tokens=rng.choice([None, 4, 12]), ignore_eos=rng.random() < 0.5)
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 10))]
        if i % 4 == 1:  # some share a prefix with an earlier one
            prompt = seqs[i - 1].prompt_token_ids[:6] + prompt[:3]
        seqs.append(Sequence(prompt, params))
        sched.add(seqs[-1])
    preempted = []
    finished = drive(sched, on_step=lambda batch: preempted.extend(batch.preempted))
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert preempted, "the pool should be too small for the batch"
    assert sched.block_manager.num_free_blocks == num_blocks
    for s in seqs:
        assert s.is_finished and (s.output_token_ids, s.finish_reason) == alone(s, **config)


def test_outgrowing_the_whole_cache_finishes_with_length():
    sched = make(num_blocks=3, block_size=2)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    grows, too_long = Sequence([1, 2, 3], params), Sequence(range(1, 8), params)
    sched.add(grows)
    assert drive(sched) == [grows]
    # 6 tokens fill the cache; the 7th was sampled but needs no K/V; the next step cannot place it.
    assert grows.finish_reason == "length" and grows.num_tokens == 7 and grows.num_output_tokens == 4
    sched.add(too_long)  # 7 tokens need 4 blocks of 2: never fits
    batch = sched.schedule()
    assert batch.finished == [too_long] and not batch.seqs and too_long.finish_reason == "length"
    assert sched.update(batch, []) == [too_long] and not sched.has_work()


def test_abort_frees_blocks_at_once():
    sched = make(num_blocks=16)
    a, b, c = Sequence(range(10)), Sequence(range(20, 30)), Sequence(range(40, 50))
    for s in (a, b, c):
        sched.add(s)
    sched.max_num_batched_tokens = 20  # a and b run, c waits
    batch = sched.schedule()
    assert batch.seqs == [a, b] and sched.num_running == 2 and sched.num_waiting == 1
    sampled = sched.fake_model(batch)  # the step runs; a is aborted before its result is applied
    assert sched.abort(a.seq_id) is a and a.finish_reason == "abort" and a.is_finished
    assert not a.block_table and sched.block_manager.num_free_blocks == 16 - 3
    assert sched.abort(c.seq_id) is c and sched.num_waiting == 0 and c.finish_reason == "abort"
    assert sched.abort(12345) is None
    assert sched.update(batch, sampled) == []  # the aborted row is skipped
    assert b.num_output_tokens == 1 and a.num_output_tokens == 0


@pytest.mark.parametrize("params,max_model_len,expect", [
    (SamplingParams(max_tokens=5), 64, ([7], "stop")),  # EOS
    (SamplingParams(max_tokens=1), 64, ([7], "stop")),  # EOS and max_tokens on the same token: stop
    (SamplingParams(max_tokens=3, ignore_eos=True), 64, ([7, 7, 7], "length")),
    (SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[7]), 64, ([7], "stop")),
    (SamplingParams(max_tokens=None, ignore_eos=True), 6, ([7, 7], "length")),  # the context length
])
def test_finish_reasons(params, max_model_len, expect):
    sched = make(max_model_len=max_model_len, eos=(7,))
    seq = Sequence([1, 2, 3, 4], params)
    sched.add(seq)
    while sched.has_work():
        batch = sched.schedule()
        sched.update(batch, [7] * len(batch.seqs))
    assert (seq.output_token_ids, seq.finish_reason) == expect
    assert seq.finish_time is not None and seq.first_token_time is not None
    assert sched.block_manager.num_free_blocks == 64


def test_update_checks_the_sampled_list_and_finish_releases():
    sched = make(budget=4)
    seq = Sequence(range(6))
    sched.add(seq)
    batch = sched.schedule()  # a chunk of 4 of the 6 prompt tokens: no token to sample
    assert batch.needs_logits == [False]
    with pytest.raises(ValueError, match="expected 1 entries"):
        sched.update(batch, [])
    with pytest.raises(ValueError, match="mid-prefill, expected None"):
        sched.update(batch, [3])
    seq.num_computed_tokens = 0
    sched.update(batch, [None])
    batch = sched.schedule()
    assert batch.needs_logits == [True]
    with pytest.raises(ValueError, match="expected a token"):
        sched.update(batch, [None])
    sched.finish(seq, "stop")  # the engine's stop strings
    assert seq.finish_reason == "stop" and not sched.has_work() and sched.block_manager.num_free_blocks == 64


def test_max_num_seqs_and_add_checks():
    sched = make(max_num_seqs=2, max_model_len=8)
    seqs = [Sequence(range(1, 4), SamplingParams(max_tokens=3, ignore_eos=True)) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    drive(sched, on_step=lambda batch: None)
    assert all(s.num_output_tokens == 3 for s in seqs)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Sequence(range(9)))
    with pytest.raises(ValueError, match="already scheduled"):
        s = Sequence([1])
        sched.add(s)
        sched.add(s)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(BlockManager(4, 4), 4, 0, 16)
