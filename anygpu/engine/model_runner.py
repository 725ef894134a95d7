"""The model runner: owns the paged KV cache, turns a scheduled batch into the model's flat inputs, runs the
model and samples.

A step is two halves, so that tensor-parallel workers can run the second one: ``pack`` (host side, rank 0 only)
turns the scheduled batch into one int64 message (a header of a few ints, then the flat inputs), and
``execute`` (every rank) copies it to the device and runs the forward and ``compute_logits``.  Under tensor
parallelism rank 0 hands the message to ``workers.send`` before executing it, and samples alone.

- **KV cache**: one tensor ``[2, layers, num_blocks, block_size, Hkv, D]`` in the model's dtype, sliced per layer
  (Hkv: this rank's KV heads under tensor parallelism; the block count is the smallest any rank can hold).
  On GPUs it takes ``gpu_memory_utilization`` of the device minus what the weights and a warmup forward at the
  full token budget use (nano-vllm's sizing); on the CPU ``kv_cache_memory`` bytes (default 1 GiB, capped by
  what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use).
- **Inputs**: each scheduled sequence brings ``num_tokens`` new tokens starting at its ``num_computed_tokens``;
  they are packed end to end with their positions and cache slots.  Logits are computed only for sequences
  whose prompt is complete after the step (a prefill chunk that stops mid-prompt needs none).
- **Decode graphs** (CUDA and HIP): a step where every sequence brings one token replays a graph captured for
  the smallest batch size >= B (1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``), with the inputs copied into
  static buffers.  Block tables are padded to ``max_model_len`` and ``paged_decode`` gets ``max_model_len`` as
  its bound, so one graph serves every context length.  Padded rows write to slot -1 (skipped) and read
  nothing (seqlen 0).  Every rank captures the same graphs in the same order (NCCL collectives are captured).
  ``close()`` releases them: NCCL cannot destroy a communicator while a graph that captured one of its
  collectives exists (``destroy_process_group`` would wait forever), so under tensor parallelism the graphs go
  first.
- **Prefill graphs** (``prefill_graphs.py``, one rank): a lone fresh prompt of up to 512 tokens (and the token
  budget) runs padded to a bucket's row count, replayed from a graph unless ``enforce_eager``.
- **Greedy tokens in the graph**: each decode graph also captures the argmax of its logits rows, the token a
  greedy row samples (``Sampler``'s shortcut computes exactly that, on the same fp32 logits: the first largest
  value, NaN above all).  When every sequence of the step is plainly greedy (``sampler._plain_greedy``: no
  temperature, penalty, grammar or log-probabilities), the sampler takes those ids and the host copies B ints
  instead of launching an argmax after the replay; any other step samples the graph's logits as before.  The
  argmax is in every replay, sampled steps included (one read of the logits, small next to sampling them), and
  in two passes over a large vocabulary (``row_argmax``: the same indices, faster on a GPU).
  ``graph_argmax = False`` ignores it (the tests compare both ways).
- **Launched, not awaited** (``launch``): a decode step whose rows sample from their logits alone (greedy, or
  temperature / top-k / top-p / min-p with or without a seed; ``sampler.samples_without_history``) can be
  enqueued with its sampling and the copy of its ids to pinned host memory and read later, and the step after
  it enqueued before that read, its ids copied on the device from the first one's tokens (``LLMEngine``'s
  run-ahead).  Under tensor parallelism greedy steps only: a worker takes the ids from its own argmax.
- **All-reduce** (tensor parallelism): every rank's runner first calls ``tp.init_fast_all_reduce`` (collective,
  before any other collective and before capture), which sets up the symmetric-memory all-reduce for
  messages up to ``max_num_seqs`` rows of hidden size (parallel.py).  Its kernels wait for the peers with no
  timeout and nothing can abort them, so under it rank 0 polls the end of each step instead of blocking in a
  device sync: a worker that dies mid-step makes the step raise (the monitor thread saw it) rather than hang.
"""

from __future__ import annotations

import time
from array import array

import torch
import torch.distributed as dist

from ..models.llama import MODES, AttentionBatch, LlamaForCausalLM
from ..ops.paged_decode import planned_splits
from .prefill_graphs import PrefillGraphs
from .row_argmax import row_argmax
from .sampler import Sampler, _plain_greedy, generator_states, prompt_logprobs, restore_generators, samples_without_history
from .scheduler import ScheduledBatch

CPU_KV_CACHE_BYTES = 1 << 30
# Prefill sizes the GPU warmup also runs (``_warmup``): powers of two and one past them, where the quantized GEMMs'
# plans change kernel or config (int8_matmul.PATH_LIMITS and the 4-bit formats' row buckets).
WARMUP_ROWS = (1, 2, 4, 8, 16, 17, 32, 33, 48, 49, 64, 65, 128, 129, 256, 257)
# A step message: HEADER ints (mode index in MODES, tokens T, sequences B, block-table width, max_seqlen_q,
# max_seqlen_k, logit rows R, ids from the last step: 1 when a decode step's ids are the argmax rows of the step
# executed before it, on every rank), then ids [T], positions [T], slots [T], cu_seqlens_q [B + 1], seqlens_k
# [B], block tables [B * width] and, unless every token needs its logits (R == T), the R row indices.
HEADER = 8
STEP_TIMEOUT_S = 600.0  # rank 0's wait for a step under the symmetric-memory all-reduce (NCCL's default timeout)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    sizes = sorted(set(sizes) | {max_num_seqs})
    return sizes


class LaunchedStep:
    """A decode step in flight (``ModelRunner.launch``): its tokens, sampled on the device, on the way to host
    memory."""

    __slots__ = ("runner", "batch", "host", "done")

    def __init__(self, runner: ModelRunner, batch: ScheduledBatch, host: torch.Tensor, done: torch.cuda.Event | None):
        self.runner, self.batch, self.host, self.done = runner, batch, host, done

    def tokens(self) -> list[int]:
        """The step's tokens, one per sequence: waits for this step only (not for one launched behind it)."""
        runner = self.runner
        if self.done is not None:
            if runner._poll_steps:
                runner._wait_for_step(self.done)
            else:
                self.done.synchronize()
        if runner.workers is not None:
            runner.workers.check()  # a worker that died mid-step leaves garbage logits behind
        return self.host.tolist()


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, *, block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False, workers=None):
        """``workers``: rank 0's handle on its tensor-parallel workers (``send(message)``), None otherwise."""
        self.model = model
        self.config = model.config
        self.tp = model.tp
        self.workers = workers
        self.num_kv_heads = model.shard.num_kv_heads
        self.device = next(model.parameters()).device
        self.dtype = model.norm.weight.dtype  # the model's dtype (the embedding may be kept as GGUF blocks)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.sampler = Sampler()
        self._splits: dict[int, int | None] = {}  # _decode_splits': batch size -> split count
        self._table_copies: dict[int, tuple[list[int], array]] = {}  # pack's: seq_id -> (block_table, its int64 copy)
        cfg = self.config
        # batch size -> (graph, its logits [size, V], their argmax [size]: the greedy tokens)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.graph_argmax = True  # hand a graph's argmax to the sampler (False: it samples the logits)
        self.greedy: torch.Tensor | None = None  # execute's: the last step's argmax rows, from its decode graph
        self._host_ids: list[torch.Tensor] | None = None  # launch's pinned token buffers
        self._last = (None, None)  # the last decode step's (logits, its tokens: graph argmax, launch's, or None)
        self._flip = 0
        if self.tp.world_size > 1:  # first: its setup is collective, and the warmup below all-reduces already
            self.tp.init_fast_all_reduce(max_num_seqs * cfg.hidden_size, self.dtype, self.device)
        # Rank 0 polls for the end of a step (see the docstring); the workers never wait for one.
        self._poll_steps = workers is not None and self.tp.all_reduce_path == "symm_mem"
        self._step_done: torch.cuda.Event | None = None
        self.block_bytes = 2 * cfg.num_layers * block_size * self.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        if num_blocks is None:
            num_blocks = self._blocks_that_fit(kv_cache_memory, gpu_memory_utilization, max_num_batched_tokens)
            if self.tp.world_size > 1:  # one block manager (rank 0's) hands out block ids valid on every rank
                count = torch.tensor([num_blocks], device=self.device)
                dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.tp.group)
                num_blocks = int(count.item())
        if num_blocks < 1:
            raise ValueError(f"num_blocks: the KV cache has room for no block of {self.block_bytes} bytes; lower "
                             f"max_num_batched_tokens or raise the memory given to the cache")
        self.num_blocks = num_blocks
        self.kv_cache = torch.empty(2, cfg.num_layers, num_blocks, block_size, self.num_kv_heads, cfg.head_dim,
                                    dtype=self.dtype, device=self.device)
        model.set_kv_caches([(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(cfg.num_layers)])
        # Decode graphs over the Triton kernels and over the ops' references alike (ANYGPU_KERNELS=reference, or a
        # GPU Triton cannot target): a decode step's references never wait for the host.
        # A lone prompt's prefill at a bucket's row count (prefill_graphs.py), eager steps included.
        self.prefill = None
        if self.device.type == "cuda" and self.tp.world_size == 1:
            self.prefill = PrefillGraphs(model, self.device, min(max_num_batched_tokens, max_model_len))
        if self.device.type == "cuda" and not enforce_eager:
            try:
                self._capture_decode_graphs()
                if self.prefill is not None:
                    self.prefill.capture()
            except BaseException:
                self.close()  # graphs captured so far would block the process group's destruction
                raise

    def close(self) -> None:
        """Release the decode and prefill graphs (before the process group is destroyed, see above); later steps run
        eagerly.  Safe to call twice."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        if self.prefill is not None:
            self.prefill.close()

    # -- KV cache sizing -------------------------------------------------------------------------------
    def _blocks_that_fit(self, kv_cache_memory, utilization, max_num_batched_tokens) -> int:
        cap = self.max_num_seqs * self.max_blocks_per_seq  # more could never be used at once
        if kv_cache_memory is not None:
            return min(cap, int(kv_cache_memory) // self.block_bytes)
        if self.device.type != "cuda":
            return min(cap, CPU_KV_CACHE_BYTES // self.block_bytes)
        # Warm up at the full token budget with a throwaway cache, then give the cache what is left.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup(max_num_batched_tokens)
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        used = total - free
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        budget = int(total * utilization - used - peak + current)
        return min(cap, max(budget, 0) // self.block_bytes)

    def _warmup(self, tokens: int) -> None:
        """A prefill at the full token budget (the KV cache gets what it leaves), then one at each of
        WARMUP_ROWS below it: a GEMM's plan picks its kernel config by rows, and a config first met by a
        request would be compiled in the middle of serving it (about a second of stall for every sequence
        in the batch)."""
        cfg = self.config
        tokens = min(tokens, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        cache = torch.zeros(2, cfg.num_layers, blocks, self.block_size, self.num_kv_heads, cfg.head_dim,
                            dtype=self.dtype, device=self.device)
        self.model.set_kv_caches([(cache[0, i], cache[1, i]) for i in range(cfg.num_layers)])
        with torch.inference_mode():
            for n in (tokens, *(r for r in WARMUP_ROWS if r < tokens)):
                ids = torch.zeros(n, dtype=torch.long, device=self.device)
                batch = AttentionBatch(positions=torch.arange(n, device=self.device),
                                       slot_mapping=torch.arange(n, device=self.device), mode="prefill",
                                       cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device),
                                       max_seqlen_q=n)
                self.model.compute_logits(self.model(ids, batch)[-1:])
        del cache
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    # -- one step ---------------------------------------------------------------------------------------
    def pack(self, batch: ScheduledBatch, ahead: bool = False
             ) -> tuple[torch.Tensor, list[int | None], list[tuple[int, int, int]]]:
        """The step as one host int64 message (see HEADER), the index of each sequence's last token if it needs
        logits, and the prompt positions whose logits give prompt log-probabilities: (sequence index, index of the
        first token, count).  ``ahead``: a decode step packed while the step before it is still running
        (``launch``): every position one further than the scheduler's cursor, ids left 0 (the device
        fills them in).  One tensor: a single host-to-device copy (a decode step would otherwise pay five
        small synchronous copies) and a single message to each tensor-parallel worker.

        Host time here delays every step, so the loop works a sequence at a time, never a token at a time: a
        one-token chunk (every decode) takes its id, position and slot directly, a longer chunk its slots a block
        at a time; and the message goes through an ``array`` (``torch.tensor`` on a list is several times slower)."""
        ids, positions, slots, q_lens, k_lens, logit_rows, prompt_rows = [], [], [], [], [], [], []
        bs = self.block_size
        t = 0  # tokens so far
        for i, (seq, n, needs_logits) in enumerate(zip(batch.seqs, batch.num_tokens, batch.needs_logits)):
            start = seq.num_computed_tokens + ahead
            end = start + n
            if seq.needs_prompt_logprobs and start == len(seq.prompt_logprobs):  # this chunk's prompt positions
                count = min(end, seq.num_prompt_tokens - 1) - start
                if count > 0:
                    prompt_rows.append((i, t, count))
            table = seq.block_table
            if n == 1:
                ids.append(0 if ahead else seq.token(start))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_range(start, end))
                positions.extend(range(start, end))
                for b in range(start // bs, (end - 1) // bs + 1):  # the chunk's part of each block it touches
                    first = table[b] * bs
                    slots.extend(range(first + max(start - b * bs, 0), first + min(end - b * bs, bs)))
            t += n
            q_lens.append(n)
            k_lens.append(end)
            logit_rows.append(t - 1 if needs_logits else None)
        if all(n == 1 for n in q_lens):
            mode = "decode"
        elif all(s.num_computed_tokens == 0 for s in batch.seqs):
            mode = "prefill"
        else:
            mode = "mixed"
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        # A plain prefill attends to its new K/V only: no block tables.
        width = 0 if mode == "prefill" else (max(k_lens) + bs - 1) // bs
        if prompt_rows:
            rows = sorted({r for r in logit_rows if r is not None}.union(
                *(range(first, first + count) for _, first, count in prompt_rows)))
        else:  # one row per sequence that needs logits: already in order and distinct
            rows = [r for r in logit_rows if r is not None]
        header = [MODES.index(mode), t, len(q_lens), width, max(q_lens), max(k_lens), len(rows), int(ahead)]
        if len(rows) == t:  # a decode step: every token needs its logits, no gather
            rows = []
        message = array("q", header)
        for part in (ids, positions, slots, cu, k_lens):
            message.extend(part)
        if width:
            self._extend_tables(message, batch.seqs, width)
        message.extend(rows)
        return torch.frombuffer(message, dtype=torch.long), logit_rows, prompt_rows

    def _extend_tables(self, message: array, seqs, width: int) -> None:
        """Append each sequence's block table, cut or zero-padded to ``width``.  The tables come from int64 copies
        kept from the previous step (a table only grows while its sequence holds it, and a new one is a new list:
        BlockManager's rule), so a decode step converts only the blocks added since, not every table's ints."""
        old, kept = self._table_copies, {}
        for seq in seqs:
            table = seq.block_table
            entry = old.get(seq.seq_id)
            if entry is None or entry[0] is not table or len(entry[1]) > len(table):
                entry = (table, array("q", table))
            elif len(entry[1]) < len(table):
                entry[1].extend(table[len(entry[1]):])
            kept[seq.seq_id] = entry  # the tables of this step's sequences only: finished ones drop out
            row = entry[1]
            if len(row) > width:
                message.extend(row[:width])
            else:
                message.extend(row)
                if len(row) < width:
                    message.extend(array("q", bytes(8 * (width - len(row)))))
        self._table_copies = kept

    def execute(self, message: torch.Tensor) -> torch.Tensor | None:
        """Run a packed step on this rank: fill the KV cache, and return the fp32 logits of the rows that need
        them (None when none do).  Every rank of a tensor-parallel group executes every message.  The argmax of
        each returned row is left in ``self.greedy`` when a decode graph computed it (else None): ``run`` hands it
        to the sampler."""
        self.greedy = None
        logits, self.greedy = self._execute(message)
        return logits

    @torch.inference_mode()
    def _execute(self, message: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``execute``'s logits, and with them the argmax of each row when a decode graph computed it (else
        None)."""
        mode, t, b, width, max_q, max_k, num_rows, ids_from_last = message[:HEADER].tolist()
        mode = MODES[mode]
        payload = message[HEADER:]
        if self.device.type == "cuda":
            payload = payload.pin_memory().to(self.device, non_blocking=True)
        ids, positions, slots, cu, k_lens, tables, rows = payload.split(
            [t, t, t, b + 1, b, b * width, payload.numel() - 3 * t - 2 * b - 1 - b * width])
        if ids_from_last:  # run ahead: the step before this one is this step's ids, still on the device
            last_logits, last_greedy = self._last
            ids = last_greedy[:t] if last_greedy is not None else last_logits[:t].argmax(dim=-1)
        self._last = (None, None)
        if mode == "prefill" and b == 1 and num_rows == 1 and self.prefill is not None:
            bucket = self.prefill.bucket(t)
            if bucket is not None:  # a lone prompt, its last token's logits only
                logits, greedy = self.prefill.run(ids, positions, slots, bucket)
                return logits, greedy if self.graph_argmax else None
        attn = AttentionBatch(positions=positions, slot_mapping=slots, mode=mode, max_seqlen_q=max_q,
                              max_seqlen_k=max_k, num_splits=self._decode_splits(b) if mode == "decode" else None)
        if mode != "decode":
            attn.cu_seqlens_q = cu.int()
        if mode != "prefill":
            attn.seqlens_k = k_lens.int()
            attn.block_tables = tables.view(b, width).int()
        if num_rows == 0:  # only prefill chunks that stop mid-prompt: fill the cache, nothing to sample
            self.model(ids, attn)
            return None, None
        every_row = num_rows == t
        if mode == "decode" and self._graph_size(t) is not None:
            logits, greedy = self._replay(ids, attn)
            if every_row:
                self._last = (logits, greedy)
                return logits[:t], greedy[:t] if self.graph_argmax else None
            return logits.index_select(0, rows), None
        hidden = self.model(ids, attn)
        logits = self.model.compute_logits(hidden if every_row else hidden.index_select(0, rows))
        if mode == "decode" and every_row:
            self._last = (logits, None)  # its argmax only if a step run ahead asks (the CPU, eager steps)
        return logits, None

    # -- decode steps launched without waiting (run-ahead) --------------------------------------------------
    def can_launch(self, batch: ScheduledBatch) -> bool:
        """``launch`` takes this step: decode only, and every row's token a function of its logits alone
        (``samples_without_history``: greedy or sampled, seeded or not; no penalty, grammar or log-probabilities).
        On a GPU it needs a decode graph for its size, and the graph's argmax for a greedy batch.  Under tensor
        parallelism only greedy batches: the workers take a step run ahead's ids from their own argmax."""
        if not batch.seqs or not all(batch.needs_logits):
            return False
        if any(n != 1 for n in batch.num_tokens) or not samples_without_history(batch.seqs):
            return False
        if any(s.needs_prompt_logprobs for s in batch.seqs):
            return False
        greedy = _plain_greedy(batch.seqs)
        if not greedy and self.workers is not None:
            return False
        if self.device.type == "cuda":
            return (self.graph_argmax or not greedy) and self._graph_size(len(batch.seqs)) is not None
        return True

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue a ``can_launch`` step, its sampling and the copy of its tokens to host memory, without waiting for
        the device.  ``after``: the step still running whose tokens are this step's input: each sequence one
        position further than the scheduler's cursor (it has not seen ``after``'s tokens yet), and the ids
        copied on the device from ``after``'s tokens, so the host never waits between the two.  ``after`` must be
        the step executed last (on every rank: tensor-parallel workers run the same messages in the same order).
        A seeded row draws from its generator once per step, as stepping one at a time does; if sampling raises,
        the generators are put back and the exception propagates (the engine then runs the step scheduled)."""
        b = len(batch.seqs)
        message, _, _ = self.pack(batch, ahead=after is not None)
        if self.workers is not None:
            self.workers.send(message)
        logits, greedy = self._execute(message)
        states = generator_states(batch.seqs)
        try:
            tokens = self.sampler.sample_tensor(logits, batch.seqs, greedy)
        except Exception:
            restore_generators(batch.seqs, states)
            raise
        # The next step run ahead takes these ids (``_execute``), not the graph's argmax; the graph's logits stay
        # valid until then (its next replay is that step's).
        self._last = (logits, tokens)
        if self.device.type != "cuda":  # the CPU computed as it launched
            return LaunchedStep(self, batch, tokens, None)
        if self._host_ids is None:  # two: the step being read and the one launched behind it
            self._host_ids = [torch.empty(self.max_num_seqs, dtype=torch.long, pin_memory=True) for _ in range(2)]
        host = self._host_ids[self._flip]
        self._flip ^= 1
        host[:b].copy_(tokens[:b], non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return LaunchedStep(self, batch, host[:b], done)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None | Exception]:
        """Run one scheduled step; returns the sampled token of each sequence (None where no logits were needed,
        the exception where sampling that sequence failed: ``Sampler.sample_each``)."""
        message, logit_rows, prompt_rows = self.pack(batch)
        if self.workers is not None:
            self.workers.send(message)
        self.greedy = None
        try:
            logits = self.execute(message)
        except Exception as e:
            if self.workers is not None:
                self.workers.check(e)  # a collective failed because a worker did: say which and why
            raise
        if self._poll_steps:
            self._wait_for_step(self._step_event())
        if logits is None:
            return [None] * len(logit_rows)
        greedy = self.greedy
        seqs = [s for s, r in zip(batch.seqs, logit_rows) if r is not None]
        failed = {}
        if prompt_rows:  # logits came for more rows than the sampled ones: pick those out first
            t, num_rows = int(message[1]), int(message[6])
            where = {r: j for j, r in enumerate(range(t) if num_rows == t else message[-num_rows:].tolist())}
            failed = self._prompt_logprobs(batch, logits, where, prompt_rows)
            logits = logits[torch.tensor([where[r] for r in logit_rows if r is not None], dtype=torch.long,
                                         device=logits.device)]
            greedy = None
        sampled = iter(self.sampler.sample_each(logits, seqs, greedy) if seqs else [])
        if self.workers is not None:
            self.workers.check()  # a worker that died mid-step leaves garbage logits behind (its NCCL group aborted)
        results = [next(sampled) if r is not None else None for r in logit_rows]
        for i, error in failed.items():
            results[i] = error
        return results

    @staticmethod
    def _prompt_logprobs(batch: ScheduledBatch, logits: torch.Tensor, where: dict[int, int],
                         prompt_rows: list[tuple[int, int, int]]) -> dict[int, Exception]:
        """Append each chunk's prompt log-probabilities to its sequence; a sequence whose computation fails gets
        the exception instead (``LLMEngine`` then fails that request alone)."""
        failed = {}
        for i, first, count in prompt_rows:
            seq = batch.seqs[i]
            start = seq.num_computed_tokens
            try:
                rows = logits[where[first]: where[first] + count]  # consecutive tokens: consecutive rows
                targets = seq.prompt_token_ids[start + 1: start + 1 + count]
                seq.prompt_logprobs.extend(prompt_logprobs(rows, targets, seq.params.prompt_logprobs))
            except Exception as error:
                failed[i] = error
        return failed

    def _step_event(self) -> torch.cuda.Event:
        """An event recorded after the work enqueued so far (one, reused)."""
        if self._step_done is None:
            self._step_done = torch.cuda.Event()
        self._step_done.record(torch.cuda.current_stream(self.device))
        return self._step_done

    def _wait_for_step(self, done: torch.cuda.Event) -> None:
        """Rank 0 under the symmetric-memory all-reduce: wait for this step's kernels by polling an event, raising
        once the monitor thread has seen a worker die (or after STEP_TIMEOUT_S).  A blocking sync would never
        return then: the all-reduce kernel waits for the dead peer forever.  The GPU stays stuck in it: the
        error says to restart the process."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not done.query():
            stuck = time.monotonic() > deadline
            if self.workers.failure is not None or stuck:
                reason = "a worker died" if not stuck else f"a step did not finish in {STEP_TIMEOUT_S:.0f} s"
                self.workers.check(RuntimeError(
                    f"tp: {reason} inside a symmetric-memory all-reduce, which cannot be aborted: this GPU stays "
                    f"busy until the process exits; restart it"))
                raise RuntimeError(f"tp: {reason}; restart the process")
            time.sleep(0)  # lets other threads take the GIL, as a blocking sync would

    # -- decode graphs ---------------------------------------------------------------------------------
    def _decode_splits(self, batch_size: int) -> int | None:
        """paged_decode's split count for a decode step of ``batch_size`` sequences: the one its graph's size
        plans for max_model_len, on eager steps too (enforce_eager included).  The count sets the order of the
        attention's sums; without it an eager step planned for its own shorter context (one pass) and a
        replayed one (several splits) picked different bf16 tokens."""
        hit = self._splits.get(batch_size, False)
        if hit is False:
            size = next((s for s in graph_batch_sizes(self.max_num_seqs) if s >= batch_size), batch_size)
            hit = self._splits[batch_size] = planned_splits(size, self.num_kv_heads, self.block_size,
                                                            self.config.head_dim, self.max_model_len, self.device)
        return hit

    def _graph_size(self, batch_size: int) -> int | None:
        return next((b for b in sorted(self.graphs) if b >= batch_size), None)

    def _capture_decode_graphs(self) -> None:
        dev, n = self.device, self.max_num_seqs
        self._static = {
            "ids": torch.zeros(n, dtype=torch.long, device=dev),
            "positions": torch.zeros(n, dtype=torch.long, device=dev),
            "slots": torch.full((n,), -1, dtype=torch.long, device=dev),
            "seqlens": torch.zeros(n, dtype=torch.int32, device=dev),
            "tables": torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
        }
        self._static_logits = None
        pool = None
        for size in reversed(graph_batch_sizes(n)):
            s = self._static
            attn = AttentionBatch(positions=s["positions"][:size], slot_mapping=s["slots"][:size], mode="decode",
                                  max_seqlen_q=1, seqlens_k=s["seqlens"][:size], max_seqlen_k=self.max_model_len,
                                  block_tables=s["tables"][:size], num_splits=self._decode_splits(size))
            with torch.inference_mode():
                row_argmax(self.model.compute_logits(self.model(s["ids"][:size], attn)))  # warm up: compile, tune
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model.compute_logits(self.model(s["ids"][:size], attn))
                    greedy = row_argmax(out)  # Sampler's greedy shortcut (argmax), on the same logits
            pool = graph.pool()
            self.graphs[size] = (graph, out, greedy)
        torch.cuda.synchronize(dev)

    def _replay(self, ids: torch.Tensor, attn: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph's logits [size, V] and their argmax [size]; rows past the batch are padding."""
        b = ids.shape[0]
        size = self._graph_size(b)
        s = self._static
        s["ids"][:b].copy_(ids)
        s["positions"][:b].copy_(attn.positions)
        s["slots"][:b].copy_(attn.slot_mapping)
        s["slots"][b:size].fill_(-1)
        s["seqlens"][:b].copy_(attn.seqlens_k)
        s["seqlens"][b:size].zero_()
        width = attn.block_tables.shape[1]
        s["tables"][:b, :width].copy_(attn.block_tables)
        graph, out, greedy = self.graphs[size]
        graph.replay()
        return out, greedy
