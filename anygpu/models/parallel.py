"""Tensor parallelism: which part of the model each rank holds, and the two collectives the model needs.

``TensorParallel(rank, world_size, group)`` is handed to the model; ``LlamaShard.of(config, tp)`` says what
that rank holds (Megatron's split, as in vLLM and nano-vllm):

- attention: ``num_heads / tp`` query heads per rank (must divide).  KV heads are split the same way when
  there are at least ``tp`` of them (must divide); with fewer, each is replicated on ``tp / num_kv_heads``
  consecutive ranks, rank r holding head ``r // (tp / num_kv_heads)`` (the one its query heads read);
- MLP: ``intermediate_size / tp`` columns of gate/up and rows of down per rank (must divide);
- output head: vocab rows in chunks of ``ceil(vocab / tp)``; the last rank's chunk is padded with zero rows,
  which ``compute_logits`` cuts off after gathering so they can never be sampled;
- embedding and norms: replicated.

q/k/v and gate/up are column-parallel (each rank computes its output features: no communication), o_proj and
down_proj row-parallel (each rank a partial sum over its input features, then one ``all_reduce``).  That is two
all-reduces per layer plus one all-gather of the logits per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ModelConfig

# torch 2.13 renamed all_gather_into_tensor (same arguments) and warns on the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.  ``group``: a torch.distributed ProcessGroup, or None for
    the default group (the engine's workers use the default group)."""

    rank: int = 0
    world_size: int = 1
    group: object = None

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"tp: expected a positive int world size, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tp: rank must be in [0, {self.world_size}), got {self.rank!r}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place, in its own dtype."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n], rank order along the last dim."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        # Gathered along dim 0 (one contiguous output, which NCCL writes in one call and a CUDA graph can
        # capture; gloo wants it concatenated, not stacked), then moved to the last dim.
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x, group=self.group)
        out = out.view(self.world_size, *x.shape)
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.world_size * x.shape[-1])


def check_tp(config: ModelConfig, tp: object) -> None:
    """ValueError naming ``tp`` unless the model can be split over ``tp`` ranks."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp: expected a positive int (the number of ranks), got {tp!r}")
    heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % tp:
        raise ValueError(f"tp: {tp} ranks cannot split num_heads={heads} attention heads evenly; reduce tp to a "
                         f"divisor of {heads}")
    if kv >= tp and kv % tp:
        raise ValueError(f"tp: {tp} ranks cannot split num_kv_heads={kv} KV heads evenly; reduce tp to a divisor "
                         f"of {kv}")
    if kv < tp and tp % kv:
        raise ValueError(f"tp: with num_kv_heads={kv} < tp={tp}, each KV head is replicated, which needs tp to be "
                         f"a multiple of {kv}; reduce tp")
    if inter % tp:
        raise ValueError(f"tp: {tp} ranks cannot split intermediate_size={inter} evenly; reduce tp")


@dataclass(frozen=True)
class LlamaShard:
    """What one rank holds of a Llama-family model (the whole model when world_size is 1)."""

    num_heads: int  # query heads on this rank
    head_start: int  # index of its first query head in the checkpoint
    num_kv_heads: int
    kv_head_start: int
    intermediate: int
    intermediate_start: int
    vocab_rows: int  # rows of this rank's lm_head (ceil(vocab / tp): the same on every rank, for the gather)
    vocab_start: int
    vocab_real: int  # how many of them are real vocab rows (fewer on a padded last rank)

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel) -> LlamaShard:
        n, r = tp.world_size, tp.rank
        check_tp(config, n)
        heads, kv, inter = config.num_heads // n, config.num_kv_heads, config.intermediate_size // n
        if kv >= n:
            kv_heads, kv_start = kv // n, r * (kv // n)
        else:
            kv_heads, kv_start = 1, r // (n // kv)
        vocab_rows = -(-config.vocab_size // n)
        vocab_start = min(r * vocab_rows, config.vocab_size)
        return cls(num_heads=heads, head_start=r * heads, num_kv_heads=kv_heads, kv_head_start=kv_start,
                   intermediate=inter, intermediate_start=r * inter, vocab_rows=vocab_rows, vocab_start=vocab_start,
                   vocab_real=min(vocab_rows, config.vocab_size - vocab_start))
