"""A lone prompt's prefill at a fixed row count, replayed from a CUDA graph.

A short prompt's eager prefill is bound by the host: about ten launches a layer from Python (the op layer,
Triton's launcher, cuBLAS's), which take longer to issue than the GPU takes to run them
(``tools/profile_engine.py --prefill``).  A request arriving alone waits that long for its first token.

- **Which steps**: a prefill step of one fresh sequence (no cached prefix) that needs its last token's logits
  only (no prompt log-probabilities), of at most the largest bucket's tokens.  Batched prompts, chunks, mixed
  steps and longer prompts run eagerly as before.
- **Buckets**: the step runs at the smallest of ``BUCKETS`` at or above its tokens n, T rows: the prompt, then
  the padding as a second sequence of T - n tokens (id 0, position 0, slot -1: no cache write).  Every row is a
  well-defined token, so no garbage reaches a GEMM (an int8 model's outlier columns are found over all rows),
  and attention keeps the two sequences apart.  Buckets stop at the runner's token budget, so a graph never
  holds more activations than the warmup that sized the KV cache.
- **Eager steps pad alike** (``enforce_eager`` included): a GEMM's kernel and its bits depend on the row count,
  and a prompt's first token must not depend on whether a graph replayed it.
- **Own memory pool**, shared by the prefill graphs only: a replay never overwrites a decode graph's logits,
  which a step run ahead may still read.
- **Greedy in the graph**: the last row's argmax, as the decode graphs capture it.
- Tensor parallelism keeps eager prefills (not measured on two GPUs): ``ModelRunner`` builds this for one rank.
"""

from __future__ import annotations

import torch

from ..models.llama import AttentionBatch
from ..ops import flash_attn_varlen
from .row_argmax import row_argmax

BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512)


def buckets_for(max_tokens: int) -> tuple[int, ...]:
    """The buckets a runner with this per-step token budget uses."""
    return tuple(b for b in BUCKETS if b <= max_tokens)


def bucket_of(buckets: tuple[int, ...], tokens: int) -> int | None:
    """The row count a lone prompt of ``tokens`` tokens runs at, or None (too long: eager, unpadded)."""
    return next((b for b in buckets if b >= tokens), None)


class PrefillGraphs:
    """Static inputs, one graph per bucket (when captured), and the padded step itself."""

    def __init__(self, model, device: torch.device, max_tokens: int):
        self.model = model
        self.device = device
        self.buckets = buckets_for(max_tokens)
        rows = self.buckets[-1] if self.buckets else 0
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        # per bucket: cu_seqlens [0, n, T] and the logits row [n - 1], set before each step
        self.cu = {t: torch.tensor([0, t, t], dtype=torch.int32, device=device) for t in self.buckets}
        self.row = {t: torch.full((1,), t - 1, dtype=torch.long, device=device) for t in self.buckets}
        # bucket -> (graph, its logits [1, V], their argmax [1])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def bucket(self, tokens: int) -> int | None:
        return bucket_of(self.buckets, tokens)

    def _forward(self, t: int) -> torch.Tensor:
        """The fp32 logits [1, V] of the prompt's last token, from the static inputs of bucket ``t``."""
        attn = AttentionBatch(positions=self.positions[:t], slot_mapping=self.slots[:t], mode="prefill",
                              cu_seqlens_q=self.cu[t], max_seqlen_q=t)
        hidden = self.model(self.ids[:t], attn)
        return self.model.compute_logits(hidden.index_select(0, self.row[t]))

    def capture(self) -> None:
        """One graph per bucket, in a pool of their own; the inputs are a full bucket of padding (no cache write).
        None where attention runs its reference (``ANYGPU_KERNELS=reference``, a GPU Triton cannot target): it
        reads the sequence bounds on the host, which a graph cannot capture."""
        if not flash_attn_varlen.runs_kernel(self.device):
            return
        pool = None
        for t in reversed(self.buckets):
            with torch.inference_mode():
                row_argmax(self._forward(t))  # warm up: compile, tune
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(t)
                    greedy = row_argmax(logits)
            pool = graph.pool()
            self.graphs[t] = (graph, logits, greedy)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, t: int
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt (``ids``, ``positions``, ``slots``: its n tokens, on the device) at bucket ``t``: its KV
        written to the cache, and the logits [1, V] of its last token with their argmax (None on an eager step).
        A replay's outputs are static: read them before the next prefill."""
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        self.ids[n:t].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:t].zero_()
        self.slots[:n].copy_(slots)
        self.slots[n:t].fill_(-1)
        self.cu[t][1].fill_(n)
        self.row[t].fill_(n - 1)
        hit = self.graphs.get(t)
        if hit is None:
            return self._forward(t), None
        graph, logits, greedy = hit
        graph.replay()
        return logits, greedy
