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

All-reduce path: NCCL's ring costs a fixed latency per call whatever the size below a few hundred KiB, and an
8B model makes 64 calls per decode token.  ``TensorParallel.init_fast_all_reduce`` (called by every rank's model runner,
before graph capture) sets up PyTorch's symmetric-memory all-reduce where it can: one buffer per rank that
every peer maps over NVLink/P2P, and a single kernel (``symm_mem.one_shot_all_reduce_copy``: each rank copies
its input in, reads all peers' buffers and sums them in rank order, so every rank gets the same bits) instead of
NCCL's protocol.
``ANYGPU_TP_ALLREDUCE=auto|nccl|symm_mem`` picks (see ``all_reduce_mode``); messages that do not fit the
buffer, other dtypes and anything the setup could not do go through ``dist.all_reduce``.  The logits
all-gather stays NCCL (one per step).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import ModelConfig

log = logging.getLogger(__name__)

# torch 2.13 renamed all_gather_into_tensor (same arguments) and warns on the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

ALL_REDUCE_ENV = "ANYGPU_TP_ALLREDUCE"
ALL_REDUCE_MODES = ("auto", "nccl", "symm_mem")
SYMM_MEM_WORLD_SIZES = (2, 4, 6, 8)
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)  # the ops' kernels: AT_DISPATCH_FLOAT_AND_BFLOAT16 (no fp16)
SYMM_MEM_BUFFER_MAX_BYTES = 4 << 20
# Above this, with more than 2 ranks, two-shot (each rank reduces 1/N of the message and writes it to every
# peer) moves less data than one-shot (each rank reads all N messages); with 2 ranks both move the same bytes
# and one-shot has fewer steps.  vLLM's table for 4 ranks (PR 24111) has a one-shot kernel ahead up to 2 MiB and
# two-shot from 3 MiB; 1 MiB leaves room for 8 ranks (not measured here).
ONE_SHOT_MAX_BYTES = 1 << 20
_symm_mem_buffers: list[torch.Tensor] = []  # never freed: see _SymmMemAllReduce.setup


def all_reduce_mode() -> str:
    """``ANYGPU_TP_ALLREDUCE``: "auto" (default: symmetric memory where supported, else NCCL), "nccl" or
    "symm_mem" (an error where it cannot be used).  ValueError naming the variable for anything else."""
    raw = os.environ.get(ALL_REDUCE_ENV, "")
    mode = raw.strip().lower() or "auto"
    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"{ALL_REDUCE_ENV}: expected one of {', '.join(ALL_REDUCE_MODES)}, got {raw!r}")
    return mode


def symm_mem_unsupported(device: torch.device, world_size: int, dtype: torch.dtype, forced: bool = False) -> str | None:
    """Why the symmetric-memory all-reduce cannot run here, or None.  Only from what every rank sees alike
    (the setup's rendezvous is collective: the ranks must all try it or none)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} device"
    if torch.version.hip and not forced:
        return "ROCm (RCCL is used unless forced)"
    if world_size not in SYMM_MEM_WORLD_SIZES:
        return f"{world_size} ranks (supported: {', '.join(map(str, SYMM_MEM_WORLD_SIZES))})"
    if dtype not in SYMM_MEM_DTYPES:
        return f"{dtype} (the kernels take torch.bfloat16 and torch.float32)"
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 11):  # before 2.11 rendezvous needed enable_symm_mem_for_group, keyed by a reused group name
        return f"torch {torch.__version__} (needs 2.11 or later)"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"no torch.distributed._symmetric_memory ({e})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        return "this torch build has no symm_mem ops"
    return None


def check_all_reduce_mode(device: torch.device, world_size: int, dtype: torch.dtype) -> str:
    """The all-reduce mode, checked before any rank starts: a ValueError naming ``ANYGPU_TP_ALLREDUCE`` for a
    bad value, or for "symm_mem" where it cannot run."""
    mode = all_reduce_mode()
    if mode == "symm_mem" and world_size > 1:
        why = symm_mem_unsupported(device, world_size, dtype, forced=True)
        if why:
            raise ValueError(f"{ALL_REDUCE_ENV}=symm_mem: the symmetric-memory all-reduce cannot run here: {why}; "
                             f"unset it (auto) or set it to nccl")
    return mode


class _SymmMemAllReduce:
    """Sum over the ranks through one symmetric-memory buffer per rank (``setup`` makes it on every rank).

    Per call: the input goes into the first numel elements of this rank's buffer, and one kernel waits for
    every peer to have written theirs (a signal-pad barrier), reads all N buffers over NVLink and writes the
    sum (``one_shot_all_reduce``), then waits again before anyone may overwrite a buffer.  With more than 2
    ranks, messages over ONE_SHOT_MAX_BYTES take ``two_shot_all_reduce_`` (in place in the buffer).  Both are
    plain kernel launches (the rendezvous is cached), so CUDA graphs capture them, as vLLM's decode graphs do.
    No multicast (NVLS) op is used: multimem_* would need it."""

    def __init__(self, buffer: torch.Tensor, group_name: str, world_size: int, ops=None):
        self.buffer, self.group_name, self.world_size = buffer, group_name, world_size
        self.ops = ops if ops is not None else torch.ops.symm_mem
        # The copy into the buffer done by the kernel itself: one launch per call instead of two.
        self.fused_copy = hasattr(self.ops, "one_shot_all_reduce_copy")
        self.one_shot_max = buffer.numel() if world_size == 2 else ONE_SHOT_MAX_BYTES // buffer.element_size()

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can take this path (a rank-invariant decision: shapes and dtypes are the same on every
        rank).  The kernels load 16-byte vectors, at the same alignment in the buffer and in ``x``."""
        size = x.element_size()
        return (x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()
                and x.numel() * size % 16 == 0 and x.storage_offset() * size % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):  # the ops launch on the current device's stream
                return self(x)
        return self.one_shot(x) if x.numel() <= self.one_shot_max else self.two_shot(x)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        slot = self.buffer[: x.numel()].view(x.shape)
        if self.fused_copy:
            return self.ops.one_shot_all_reduce_copy(slot, x, "sum", self.group_name)
        slot.copy_(x)
        return self.ops.one_shot_all_reduce(slot, "sum", self.group_name)

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        slot = self.buffer[: x.numel()].view(x.shape)
        slot.copy_(x)
        self.ops.two_shot_all_reduce_(slot, "sum", self.group_name)
        return x.copy_(slot)  # the buffer is the next call's: the sum goes back into x, like dist.all_reduce

    @classmethod
    def setup(cls, numel: int, dtype: torch.dtype, device: torch.device, group, agree) -> _SymmMemAllReduce:
        """Allocate, rendezvous and test on every rank.  ``agree(ok)`` is a MIN over the ranks after each stage,
        so that one rank's failure makes them all stop at the same point (none is left waiting inside the next
        collective stage).  RuntimeError with the reason if any rank failed."""
        from torch.distributed import _symmetric_memory as symm_mem

        # Never used here (no multimem op), and rendezvous fails on some machines that cannot make the
        # multicast object; a setting of the user's wins.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        group_name = (group if group is not None else dist.group.WORLD).group_name
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        fast, error = None, None
        for stage in ("allocate", "rendezvous", "test"):
            try:
                with torch.cuda.device(device):  # the ops launch on the current device's stream
                    if stage == "allocate":
                        buffer = symm_mem.empty(numel, dtype=dtype, device=device)
                        _symm_mem_buffers.append(buffer)  # never freed: see below
                    elif stage == "rendezvous":
                        symm_mem.rendezvous(buffer, group_name)
                    else:  # each kernel it will use once, checked: they exist here, the peers are reachable
                        fast = cls(buffer, group_name, world_size)
                        expect = world_size * (world_size + 1) // 2
                        for path in (fast.one_shot,) if world_size == 2 else (fast.one_shot, fast.two_shot):
                            got = path(torch.full((64,), rank + 1, dtype=dtype, device=device))
                            if not bool((got == expect).all()):
                                raise RuntimeError(f"{path.__name__} gave {got[:4].tolist()}, expected {expect}")
            except Exception as e:
                error = e
            if not agree(error is None):
                why = f"{type(error).__name__}: {error}" if error is not None else "failed on another rank"
                raise RuntimeError(f"symmetric memory {stage}: {why}")
        # The buffer is kept for the life of the process, not freed with the model: a freed buffer goes back to
        # symm_mem's memory pool, and the next engine in this process would get it back with its rendezvous to
        # the old, gone workers cached under the same group name ("0"); and freeing synchronizes the device,
        # which never returns after a peer died inside an all-reduce kernel.  A few MiB per engine.
        return fast


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group.  ``group``: a torch.distributed ProcessGroup, or None for
    the default group (the engine's workers use the default group).  ``all_reduce_path``: "symm_mem", the
    group's backend ("nccl", "gloo") once ``init_fast_all_reduce`` ran, None before (and for one rank)."""

    rank: int = 0
    world_size: int = 1
    group: object = None
    all_reduce_path: str | None = field(default=None, init=False)
    _fast: _SymmMemAllReduce | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"tp: expected a positive int world size, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tp: rank must be in [0, {self.world_size}), got {self.rank!r}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in its own dtype: in place (NCCL/gloo, two-shot) or a new tensor (one-shot);
        use the returned tensor."""
        if self.world_size == 1:
            return x
        fast = self._fast
        if fast is not None and fast.fits(x):
            return fast(x)
        dist.all_reduce(x, group=self.group)
        return x

    def init_fast_all_reduce(self, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Choose the all-reduce path and set up the symmetric-memory one where it applies, for messages of up to
        ``max_numel`` elements (capped at SYMM_MEM_BUFFER_MAX_BYTES) of ``dtype``.  Collective: every rank calls
        it, in the same order relative to its other collectives, after the process group exists and before any
        CUDA graph capture.  Logs the choice on rank 0; with ``ANYGPU_TP_ALLREDUCE=symm_mem``, a RuntimeError
        naming the variable where it could not be set up."""
        if self.world_size == 1 or self.all_reduce_path is not None:
            return
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        backend = dist.get_backend(self.group)

        def agree(ok: bool) -> bool:  # every rank's verdict, the same on all: the MIN over the group
            flag = torch.tensor([int(ok)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            return bool(flag.item())

        mode = all_reduce_mode()
        forced = mode == "symm_mem"
        why = f"{ALL_REDUCE_ENV}=nccl" if mode == "nccl" else symm_mem_unsupported(device, self.world_size, dtype,
                                                                                   forced)
        if why is None:
            why = self._peer_access(device, agree)
        if why is None:
            numel = max(64, min(max_numel, SYMM_MEM_BUFFER_MAX_BYTES // dtype.itemsize))
            try:
                self._fast = _SymmMemAllReduce.setup(numel, dtype, device, self.group, agree)
            except RuntimeError as e:
                why = str(e)
                if not forced and self.rank == 0:
                    log.warning("tp: the symmetric-memory all-reduce could not be set up, using %s: %s", backend, why)
        if why is not None and forced:
            raise RuntimeError(f"{ALL_REDUCE_ENV}=symm_mem: the symmetric-memory all-reduce cannot run here: {why}")
        self.all_reduce_path = "symm_mem" if self._fast is not None else backend
        if self.rank == 0:
            if self._fast is not None:
                log.info("tp: all-reduce over symmetric memory (%d ranks, %s, messages up to %.2f MiB; %s beyond)",
                         self.world_size, dtype, self._fast.buffer.nbytes / 2**20, backend)
            else:
                log.info("tp: all-reduce over %s (%s)", backend, why)

    def _peer_access(self, device: torch.device, agree) -> str | None:
        """Why some rank cannot reach a peer's memory (None: all can).  Each rank knows only its own device."""
        devices = torch.empty(self.world_size, dtype=torch.long, device=device)
        _all_gather_single(devices, torch.tensor([device.index], device=device), group=self.group)
        blind = [d for d in devices.tolist() if d != device.index and not torch.cuda.can_device_access_peer(device, d)]
        if agree(not blind):
            return None
        return f"no peer access from cuda:{device.index} to cuda:{blind}" if blind else "no peer access on a rank"

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
