"""Tensor-parallel engine processes: rank 0 is the engine's own process, ranks 1..N-1 are spawned workers.

Start-up (driven by ``LLMEngine``):

1. ``TPWorkers(spec)`` opens a TCPStore on a free port (port 0: no race for it) and spawns one process per
   worker (``spawn``: a CUDA context cannot be forked), each with a duplex pipe to rank 0;
2. every rank builds its shard of the model from the same ``RankSpec`` (the checkpoint path or random weights,
   dtype, quantization), rank 0 in the caller's process, in parallel; each worker reports "built" (or its
   traceback) through its pipe, and ``wait_for("built")`` turns an error or a death into a RuntimeError;
3. only then does any rank join the process group (NCCL on CUDA, which is RCCL on ROCm, gloo on the CPU), so a
   failure while loading (the common one) never leaves rank 0 waiting inside a collective;
4. every rank builds its ``ModelRunner``: the KV block count (MIN over ranks), the warmup forward and the
   decode-graph captures run the same collectives in the same order everywhere; workers report "ready".

Steps: rank 0 packs each step into one int64 message (``ModelRunner.pack``) and writes it to every worker's
pipe before executing it itself; a worker executes every message it reads.  An empty message is the shutdown.

Deviation from a gloo-broadcast control plane: a pipe write costs less than a gloo broadcast per step (measured
on the CPU: docs/design/engine.md, tensor parallelism), an idle worker blocks in ``recv`` with no collective
timeout running out, and a worker whose rank 0 dies sees EOF and exits (no orphans).  Only token ids, positions and block tables cross processes.

Failures: a worker that raises sends its traceback and exits; rank 0 re-raises it as a RuntimeError naming the
worker.  A monitor thread waits on the workers' process sentinels: a worker that dies while rank 0 may be inside
an NCCL collective (which would otherwise wait for the 10-minute NCCL timeout) gets the group aborted, and the
next step raises.  (A symmetric-memory all-reduce kernel cannot be aborted: there rank 0 polls each step's end,
see model_runner.py.)

Shutdown: ``close()`` (also run when the engine is garbage collected or the interpreter exits) sends the
shutdown, releases rank 0's CUDA graphs, destroys the process group and joins the workers, each step bounded.
Under NCCL the order matters: ``destroy_process_group`` flushes and destroys the communicator, which waits for
every CUDA graph that captured one of its collectives to be destroyed (NCCL counts them; pytorch#115388) and
for the peers to destroy theirs too.  So every rank releases its decode graphs first, and the destroy runs in a
thread given DESTROY_TIMEOUT_S (a peer that died leaves it waiting; the process exit cleans up after it).
Then each worker exits with ``os._exit``, and rank 0 joins it for JOIN_TIMEOUT_S before terminating it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..models import GGUFCheckpoint, gguf_packed, open_checkpoint
from ..models.config import ModelConfig
from ..models.parallel import TensorParallel
from ..models.registry import build_model
from .model_runner import ModelRunner

STARTUP_TIMEOUT_S = 1800.0  # a worker that neither finishes nor fails a start-up stage in this long is stuck
JOIN_TIMEOUT_S = 30.0
DESTROY_TIMEOUT_S = 10.0  # destroy_process_group takes well under a second when every rank takes part
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds its part of the engine from; pickled to the workers, so the same on every rank."""

    config: ModelConfig
    model_path: str | None  # the checkpoint every rank reads its shard from; None: random weights
    dtype: torch.dtype
    device: torch.device  # rank 0's; on CUDA rank r uses the r-th device after it
    world_size: int = 1
    quantize: str | None = None
    tune: bool = False
    runner_args: dict = field(default_factory=dict)  # ModelRunner's keyword arguments

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def device_of(self, rank: int) -> torch.device:
        if self.device.type != "cuda" or self.world_size == 1:
            return self.device
        return torch.device("cuda", (self.device.index or 0) + rank)

    def build_model(self, rank: int, weights=None, progress: bool = False, checkpoint=None):
        """This rank's model; ``weights``: an already opened checkpoint's iterator (rank 0), else read here;
        ``checkpoint``: that opened checkpoint, so a GGUF kept packed is not parsed a second time."""
        prepare = None
        if (self.quantize is None and self.model_path and str(self.model_path).endswith(".gguf")
                and gguf_packed.enabled(self.device, self.world_size)):
            # The projections stay in the file's packed blocks: swapped in before the rest is loaded, and the
            # weights iterator skips their tensors, so their dequantized copies are never made.
            ckpt = checkpoint if isinstance(checkpoint, GGUFCheckpoint) else GGUFCheckpoint(self.model_path)
            weights = ckpt.weights(progress=progress, skip=gguf_packed.packed_tensors(ckpt))
            prepare = functools.partial(gguf_packed.pack_linears, checkpoint=ckpt)
        if weights is None:
            weights = open_checkpoint(self.model_path).weights(progress=progress) if self.model_path else "random"
        return build_model(self.config, weights, dtype=self.dtype, device=self.device_of(rank),
                           quantize=self.quantize, progress=progress, tp=TensorParallel(rank, self.world_size),
                           max_position=self.runner_args.get("max_model_len"), prepare=prepare)

    def build_runner(self, model, exit_stack: contextlib.ExitStack, workers: TPWorkers | None = None) -> ModelRunner:
        if self.tune:
            from ..tunable import route

            exit_stack.enter_context(route(model))
        return ModelRunner(model, workers=workers, **self.runner_args)

    def init_process_group(self, rank: int, store: dist.Store) -> None:
        # device_id binds NCCL to this rank's GPU (and creates its communicator now, not in the first forward).
        extra = {"device_id": self.device_of(rank)} if self.backend == "nccl" else {}
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=self.world_size, **extra)


class TPWorkers:
    """Rank 0's handle on the worker processes of a tensor-parallel engine."""

    def __init__(self, spec: RankSpec):
        if dist.is_initialized():
            raise ValueError("tp: torch.distributed is already initialized in this process; a tensor-parallel "
                             "engine needs its own process group (one such engine per process at a time)")
        self.spec = spec
        self.failure: str | None = None  # set by the monitor thread when a worker dies before close()
        self.runner: ModelRunner | None = None  # rank 0's: its CUDA graphs go before the process group (close)
        self._closed = False
        self._store = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        try:
            for rank in range(1, spec.world_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(rank, spec, self._store.port, theirs),
                                   name=f"anygpu-tp-rank{rank}", daemon=True)
                proc.start()
                theirs.close()  # the worker holds the only copy now: its death reads as EOF here
                self.procs.append(proc)
                self.conns.append(ours)
        except BaseException:
            self.close()
            raise
        self._stop_reader, self._stop_writer = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="anygpu-tp-monitor", daemon=True)
        self._monitor.start()

    # -- start-up --------------------------------------------------------------------------------------
    def wait_for(self, stage: str) -> None:
        """Block until every worker has reported ``stage``; a worker's error or death is a RuntimeError."""
        pending = {conn: rank for rank, conn in enumerate(self.conns, 1)}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tp: worker(s) {sorted(pending.values())} did not report {stage!r} within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s")
            for conn in multiprocessing.connection.wait(list(pending), timeout=left):
                rank = pending[conn]
                try:
                    kind, detail = conn.recv()
                except EOFError:
                    raise RuntimeError(f"tp: worker {rank} exited with code {self._exitcode(rank)} before it "
                                       f"reported {stage!r}") from None
                if kind == "error":
                    raise RuntimeError(f"tp: worker {rank} failed while starting:\n{detail}")
                if kind == stage:
                    del pending[conn]

    def init_process_group(self) -> None:
        """Rank 0 joins the process group (the workers join as soon as they have built their model)."""
        self.spec.init_process_group(0, self._store)

    def worker_errors(self) -> str:
        """Tracebacks the workers sent and nobody read yet (after a failure: the reason for it), and exit codes."""
        lines = []
        for rank, conn in enumerate(self.conns, 1):
            with contextlib.suppress(EOFError, OSError):
                while conn.poll(0.5 if not self.procs[rank - 1].is_alive() else 0):
                    kind, detail = conn.recv()
                    if kind == "error":
                        lines.append(f"worker {rank} failed:\n{detail}")
            if not self.procs[rank - 1].is_alive():
                lines.append(f"worker {rank} exited with code {self._exitcode(rank)}")
        return "\n".join(lines)

    # -- steps -----------------------------------------------------------------------------------------
    def send(self, message: torch.Tensor) -> None:
        """Hand a packed step to every worker (before rank 0 executes it)."""
        self.check()
        data = memoryview(message.numpy())
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:  # a worker that died closed its end
            raise RuntimeError(f"tp: a worker is gone ({e}); {self.worker_errors() or 'no error was reported'}") from e

    def check(self, error: BaseException | None = None) -> None:
        """Raise a RuntimeError if a worker failed (``error``: what rank 0 saw fail, chained to it)."""
        errors = self.worker_errors() if error is not None or self.failure is not None else ""
        if self.failure is not None or errors:
            raise RuntimeError(f"tp: {self.failure or 'a worker failed'}; the engine cannot continue"
                               f"\n{errors}") from error

    # -- shutdown --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and destroy the process group; safe to call twice, and after a failed start."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_stop_writer"):
            with contextlib.suppress(OSError):
                self._stop_writer.send(None)  # wake the monitor: from now on exits are expected
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")  # the shutdown message
        if self.runner is not None:
            self.runner.close()
        if not destroy_process_group(self.spec.device_of(0)):
            log.warning("tp: destroying the process group did not finish within %.0f s; left to the process exit",
                        DESTROY_TIMEOUT_S)
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self._store = None

    def _watch(self) -> None:
        """Monitor thread: a worker that exits before close() leaves rank 0 stuck in its next collective under
        NCCL (gloo notices the closed connection by itself), so abort the group to make that collective fail."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, 1)}
        ready = multiprocessing.connection.wait([*sentinels, self._stop_reader])
        if self._closed or self._stop_reader in ready:
            return
        rank = sentinels[ready[0]]
        self.failure = f"worker {rank} exited with code {self._exitcode(rank)}"
        if self.spec.backend == "nccl" and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()  # private, but the only way to unblock NCCL

    def _exitcode(self, rank: int):
        proc = self.procs[rank - 1]
        proc.join(5)
        return proc.exitcode


def _worker_main(rank: int, spec: RankSpec, store_port: int, conn) -> None:
    """A worker process: build this rank's model, join the group, build the runner, then execute every step
    rank 0 sends until the shutdown message (or EOF: rank 0 is gone)."""
    stack, runner = contextlib.ExitStack(), None
    try:
        device = spec.device_of(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the CPU's cores are shared by the ranks (as ``anygpu tune`` does over its CPU workers)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        model = spec.build_model(rank)
        conn.send(("built", None))
        store = dist.TCPStore("127.0.0.1", store_port, spec.world_size, is_master=False,
                              timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        spec.init_process_group(rank, store)
        runner = spec.build_runner(model, stack)
        conn.send(("ready", None))
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:
                break
            if not data:
                break
            runner.execute(torch.frombuffer(bytearray(data), dtype=torch.long))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise
    finally:
        stack.close()
        if runner is not None:
            runner.close()  # the graphs before the process group (see the module docstring)
        destroy_process_group(spec.device_of(rank))
    # A clean shutdown: skip the interpreter's teardown of torch (about a second of close() otherwise; and the
    # symmetric-memory buffer is not freed, which would synchronize the device).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def destroy_process_group(device: torch.device, timeout: float = DESTROY_TIMEOUT_S) -> bool:
    """``dist.destroy_process_group()`` in a daemon thread, given up on after ``timeout`` seconds (see the
    module docstring for what it can wait for); errors are ignored.  ``device``: this rank's.  True if it
    finished (or there was no group)."""
    if not dist.is_initialized():
        return True

    def destroy():
        with contextlib.suppress(Exception):
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's, for NCCL's teardown (a new thread starts on device 0)
            dist.destroy_process_group()

    thread = threading.Thread(target=destroy, name="anygpu-tp-destroy", daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()
