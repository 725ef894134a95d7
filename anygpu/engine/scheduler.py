"""``Scheduler``: continuous batching in vLLM V1's style: one token budget per step, no prefill/decode phases.

Each sequence has ``num_computed_tokens``; a step gives some sequences tokens to compute so that it catches up
with ``num_tokens``.  Per step, within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences:

1. running sequences with one token left (decodes), oldest first: one token each;
2. running sequences part-way through their prefill, oldest first: as many tokens as the budget allows;
3. waiting sequences, first come first served: admitted when the BlockManager can hold all their tokens
   (prefix-cache hits included); the one that does not fit the remaining budget is chunked.  No admission in
   a step that preempted (vLLM's rule; a guard: the victim, now first in line, could not fit anyway).

Decodes first keeps inter-token latency steady while long prompts stream in by chunks.  A sequence that wants
prompt log-probabilities computes at most ``PROMPT_LOGPROBS_CHUNK`` tokens a step: the runner materialises the
logits of each of them (a [tokens, vocab] fp32 tensor, which the KV-cache sizing did not set memory aside for).

Preemption by recomputation: when a running sequence needs a block and none is free, the most recently
arrived running sequence not already in this step's batch loses its blocks, goes back to the front of the
waiting queue with ``num_computed_tokens = 0`` and keeps its output tokens (the recomputation covers prompt
and output; its committed blocks stay in the prefix cache, so the recomputation is often mostly hits).
The oldest sequence therefore always progresses.  A lone sequence that cannot get a block, with no other
sequence left to preempt, is finished with "length": it has outgrown the cache.  A waiting sequence whose
tokens need more blocks than the whole cache is finished with "length" too.  So the scheduler never
deadlocks.  Sequences finished inside ``schedule`` come back in ``batch.finished`` and from ``update``.

Finish reasons: "stop" for an EOS id (unless ``ignore_eos``) or a ``stop_token_ids`` id, which wins over
"length" when the same token also reaches ``max_tokens``; "length" for ``max_tokens`` or ``max_model_len``;
"abort"; the engine finishes stop strings with ``finish(seq, "stop")`` and a request that failed inside a step
with ``finish(seq, "error")``.  Stop and EOS tokens are appended
to ``output_token_ids`` (the engine leaves them out of the text).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


PROMPT_LOGPROBS_CHUNK = 512  # tokens a step for a sequence whose prompt positions all need logits


def _chunk(seq: Sequence, left: int, budget: int) -> int:
    n = min(left, budget)
    return min(n, PROMPT_LOGPROBS_CHUNK) if seq.needs_prompt_logprobs else n


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)      # seqs[i] computes tokens [c, c + num_tokens[i])
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step
    finished: list[Sequence] = field(default_factory=list)   # finished by schedule() ("length": cannot fit)
    needs_logits: list[bool] = field(default_factory=list)   # seqs[i] reaches its last token: sample it

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids=()):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order: running[-1] is the newest
        self._order: dict[int, int] = {}   # seq_id -> arrival rank (add() order)
        self._ranks = itertools.count()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.max_model_len:
            raise ValueError(f"prompt: {seq.num_tokens} tokens, more than max_model_len {self.max_model_len}")
        if seq.seq_id in self._order:
            raise ValueError(f"seq_id: {seq.seq_id} is already scheduled")
        seq.status = SequenceStatus.WAITING
        self._order[seq.seq_id] = next(self._ranks)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish seq now (any state): free its blocks and take it off the queues."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._order.pop(seq.seq_id, None)
        seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, reason, time.perf_counter()

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish the waiting or running sequence seq_id with "abort"; None if there is no such sequence."""
        for seq in itertools.chain(self.running, self.waiting):
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)  # also num_computed_tokens = 0; the output tokens stay
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch, scheduled: set[int]) -> bool:
        """Blocks for n more tokens of a running seq, preempting newer sequences; False if seq lost out."""
        while not self.block_manager.ensure_slots(seq, n):
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            if victim is not seq:
                self._preempt(victim, batch)
            elif len(self.running) > 1:  # seq is the newest not yet batched: it waits, the others go on
                self._preempt(seq, batch)
                return False
            else:  # alone, and the whole cache is not enough
                self.finish(seq, "length")
                batch.finished.append(seq)
                return False
        return True

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        batch.needs_logits.append(seq.num_computed_tokens + n == seq.num_tokens)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        # Each running sequence's tokens left, read once: the decode pass can only preempt or finish sequences
        # (which leave self.running), never change what a sequence still running has left.
        lefts = [(seq, seq.num_tokens - seq.num_computed_tokens) for seq in self.running]
        bs, running = self.block_manager.block_size, SequenceStatus.RUNNING
        for seq, left in lefts:  # decodes: one token each, needing logits
            if budget == 0:
                break
            if left != 1 or seq.status is not running:
                continue  # the prefill pass's, or preempted / finished earlier in this loop
            # The table usually holds the slot already; else reserve a block (perhaps preempting).
            if seq.num_computed_tokens < len(seq.block_table) * bs or self._reserve(seq, 1, batch, scheduled):
                scheduled.add(seq.seq_id)
                self._add(batch, seq, 1)
                budget -= 1
        for seq, left in lefts:  # part-way through their prefill, as many tokens as the budget allows
            if budget == 0:
                break
            if left == 1 or seq.status is not running:
                continue
            n = _chunk(seq, left, budget)
            if self._reserve(seq, n, batch, scheduled):
                scheduled.add(seq.seq_id)
                self._add(batch, seq, n)
                budget -= n
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            if bm.blocks_needed(seq.num_tokens) > bm.num_blocks:
                self.finish(seq, "length")
                batch.finished.append(seq)
                continue
            if not bm.allocate(seq):
                break  # first come first served: no overtaking of the head
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: self._order[s.seq_id])
            n = _chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            scheduled.add(seq.seq_id)
            self._add(batch, seq, n)
            budget -= n
        return batch

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Apply a computed step; sampled[i] is seqs[i]'s new token, None while it is mid-prefill.

        Returns the sequences finished by this step, and those finished by schedule()."""
        if len(sampled) != len(batch.seqs):
            raise ValueError(f"sampled: expected {len(batch.seqs)} entries (one per sequence), got {len(sampled)}")
        finished = list(batch.finished)
        running, bs = SequenceStatus.RUNNING, self.block_manager.block_size
        for seq, n, token in zip(batch.seqs, batch.num_tokens, sampled):
            if seq.status is not running:
                continue  # aborted or finished between schedule() and update()
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                if token is not None:  # sampling it would also advance a seeded generator
                    raise ValueError(f"sampled: sequence {seq.seq_id} is mid-prefill, expected None, got {token}")
                self.block_manager.commit(seq)
                continue
            if token is None:
                raise ValueError(f"sampled: sequence {seq.seq_id} finished its prefill or decoded, expected a token")
            seq.append_token(token)
            if seq.num_computed_tokens // bs > len(seq.block_hashes):  # a block filled up (else nothing to commit)
                self.block_manager.commit(seq)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None
