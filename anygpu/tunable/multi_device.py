"""``anygpu tune`` over several devices: the work split round-robin, one spawned worker process per device.

Work is a list of GEMMs (``Work``: the results file's two signature strings and what asked for it).
``run(work, workers)`` tunes it: with one worker in this process, else in one ``spawn`` process per worker
(a fresh interpreter: no CUDA/HIP context is inherited).  Worker ``i`` of ``N`` takes items ``i, i + N,
...``; a GPU worker calls ``torch.cuda.set_device(ordinal)`` and tunes through ``tunable.mm / linear /
bmm`` as any process does, so every result is merge-written into **its own ordinal's** results file (the
``%d`` rule of ``controls.device_filename``) the moment it is decided, under the file lock.  A worker
that fails or dies loses nothing the others, or it, already wrote.

When the work is done, entries are shared: each worker's results are merged into the files of the other
workers whose validators are identical (same arch, device name, library versions), so on a machine of
identical GPUs every ``results<ordinal>.csv`` ends with every entry -- what a tensor-parallel engine, one
process per GPU, reads.  An entry a device already had for the same GEMM is kept (first line wins).

On the CPU backend a "device" is a worker process: ``N`` workers share the cores (``torch`` threads split
between them) and all write the one CPU results file.  Their timings disturb each other; it exists so the
parallel path runs, and is tested, without a GPU.

Failures: an item that raises is reported with its device and the worker goes on with its next item; a
worker that dies (a crash, the OOM killer) is reported with its exit code and how far it got.
``Report.ok`` is False in either case (``anygpu tune`` then exits with status 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import traceback

import torch
from tqdm import tqdm

from .._progress import disabled
from . import results


@dataclasses.dataclass(frozen=True)
class Work:
    op_signature: str  # "GemmTunableOp_BFloat16_TN"
    params_signature: str  # "tn_4096_1_4096_ld_4096_4096_4096"
    label: str = ""  # what asked for it: "--shape 1,4096,4096", "qkv_proj M=4", "untuned"


@dataclasses.dataclass(frozen=True)
class Worker:
    device: str  # torch device string: "cuda:1", "cpu"
    name: str  # for messages and the table: "cuda:1", "cpu#0"


@dataclasses.dataclass
class Row:
    work: Work
    worker: str  # Worker.name
    solution: str | None = None  # None: it failed (error says why) or was never reached
    time_ms: float | None = None
    error: str | None = None


@dataclasses.dataclass
class Report:
    rows: list  # a Row per work item, in work order
    failures: list  # one line each: "cuda:1: GemmTunableOp_...: RuntimeError: ..."
    paths: list  # the results files written
    # "PATH: OS error" of each results file that could not be written (a directory, an immutable file...):
    # tuning only warns about it (see ops.take_save_errors); ``anygpu tune`` fails on it.
    write_errors: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.write_errors


def split(items: list, parts: int) -> list[list]:
    """Round-robin: part ``i`` gets items ``i, i + parts, ...``."""
    return [items[i::parts] for i in range(parts)]


def parse_devices(text: str, backend_name: str, count: int, cpu_limit: int | None = None) -> list[Worker]:
    """The workers ``--devices`` asks for.  ``N``: the first N GPUs; ``all``: every visible GPU; ``0,2,3``
    (or ``3,`` for one): those ordinals.  On the CPU backend only ``N`` (N worker processes, at most the
    number of cores) and ``all`` (one).  ValueError saying what is wrong."""
    value = str(text).strip().lower()
    if backend_name == "cpu":
        limit = cpu_limit or os.cpu_count() or 1
        if value == "all":
            return [Worker("cpu", "cpu#0")]
        if not value.isdigit():
            raise ValueError(f"expected a number of worker processes on the CPU backend (it has no device "
                             f"ordinals), or 'all', got {text!r}")
        n = int(value)
        if not 1 <= n <= limit:
            raise ValueError(f"expected 1 to {limit} worker processes (CPU cores here), got {n}")
        return [Worker("cpu", f"cpu#{i}") for i in range(n)]
    if count < 1:
        raise ValueError(f"no {backend_name} GPU is visible")
    if value == "all":
        ordinals = list(range(count))
    elif value.isdigit():
        n = int(value)
        if not 1 <= n <= count:
            raise ValueError(f"expected a number of GPUs from 1 to {count} ({count} visible), got {n}")
        ordinals = list(range(n))
    else:
        parts = value[:-1].split(",") if value.endswith(",") else value.split(",")
        if len(parts) < 2 and not value.endswith(","):
            raise ValueError(f"expected N, 'all' or comma-separated device ordinals (0,2,3; '3,' for one), "
                             f"got {text!r}")
        ordinals = []
        for part in parts:
            part = part.strip()
            if not part.isdigit():
                raise ValueError(f"expected device ordinals (non-negative integers), got {part!r} in {text!r}")
            if int(part) >= count:
                raise ValueError(f"device {part} does not exist: {count} {backend_name} GPU(s) are visible "
                                 f"(ordinals 0 to {count - 1})")
            if int(part) in ordinals:
                raise ValueError(f"device {part} is listed twice in {text!r}")
            ordinals.append(int(part))
    return [Worker(f"cuda:{i}", f"cuda:{i}") for i in ordinals]


def _error(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def tune_items(items: list, device: torch.device, report) -> None:
    """Tune each ``(index, Work)`` on ``device`` (this process), calling ``report(index, entry, error)``
    after each; an item that raises is reported and the next one tried."""
    from .signatures import parse_signatures
    from .warmup import tune_problem

    for index, work in items:
        try:
            problem = parse_signatures(work.op_signature, work.params_signature)
            if problem is None:
                raise ValueError(f"not a GEMM we tune: {work.op_signature},{work.params_signature}")
            entry = tune_problem(problem, device)
        except Exception as e:  # noqa: BLE001 - reported with its device; the other items go on
            report(index, None, _error(e))
            continue
        report(index, entry, None)


def _worker_main(number: int, worker: Worker, backend_name: str, settings: dict, threads: int, items: list,
                 messages) -> None:
    """A worker process: pin the device, apply the parent's settings, tune ``items``, report each through
    ``messages`` (the write end of a pipe to the parent, its own: a worker that dies cannot block another)."""
    os.environ["ANYGPU_BACKEND"] = backend_name
    try:
        from .. import backend
        from . import controls
        from . import ops as tune_ops

        backend.reset()
        controls.set(**settings)
        if threads:
            torch.set_num_threads(threads)
        device = torch.device(worker.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ordinal = max(device.index or 0, 0)
        path = controls.current().results_path(ordinal)
        messages.send(("ready", number, results.current_validators(ordinal), path))

        def report(index, entry, error):
            messages.send(("item", number, index, entry, error))

        tune_items(items, device, report)
        messages.send(("save_errors", number, tune_ops.take_save_errors()))
        messages.send(("finished", number))
    except BaseException as e:
        with contextlib.suppress(Exception):  # the parent may be gone (interrupted)
            messages.send(("crashed", number, _error(e), traceback.format_exc()[-2000:]))
        raise


def run(work: list, workers: list, settings: dict, progress: bool = True, target=None) -> Report:
    """Tune ``work`` (a list of ``Work``) over ``workers`` (``parse_devices``) with ``settings`` (the
    TunableOp controls each worker applies: ``dataclasses.asdict(controls.current())``).  One worker runs in
    this process; more run in spawned processes (``target``: the worker function, for tests)."""
    rows = [Row(w, "") for w in work]
    failures: list = []
    write_errors: dict = {}  # path -> "PATH: OS error"
    where = "processes" if workers[0].device == "cpu" else "devices"
    bar = tqdm(total=len(work), desc="tuning" if len(workers) == 1 else f"tuning in {len(workers)} {where}",
               unit="gemm", disable=disabled(progress))
    with bar:
        if len(workers) == 1 and target is None:
            paths = _run_here(rows, workers[0], settings, failures, bar, write_errors)
        else:
            paths = _run_spawned(rows, workers, settings, failures, bar, target or _worker_main, write_errors)
    written = [p for p in paths if os.path.isfile(p) and p not in write_errors]
    return Report(rows, failures, written, list(write_errors.values()))


def _run_here(rows: list, worker: Worker, settings: dict, failures: list, bar, write_errors: dict) -> list:
    from . import controls
    from . import ops as tune_ops

    device = torch.device(worker.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def report(index, entry, error):
        _record(rows, index, worker.name, entry, error, failures)
        bar.update()

    with controls.settings(**settings) as s:
        tune_ops.take_save_errors()  # this run's, not an earlier caller's
        tune_items(list(enumerate(r.work for r in rows)), device, report)
        write_errors.update(tune_ops.take_save_errors())
        return [s.results_path(max(device.index or 0, 0))]


def _record(rows, index, name, entry, error, failures) -> None:
    row = rows[index]
    row.worker = name
    if entry is not None:
        row.solution, row.time_ms = entry.solution, entry.time_ms
    else:
        row.error = error
        failures.append(f"{name}: {row.work.op_signature},{row.work.params_signature} ({row.work.label}): {error}")


def _run_spawned(rows: list, workers: list, settings: dict, failures: list, bar, target, write_errors: dict) -> list:
    from .. import backend

    backend_name = backend.name()
    cpu_threads = max(1, (os.cpu_count() or 1) // len(workers)) if backend_name == "cpu" else 0
    shares = split(list(enumerate(r.work for r in rows)), len(workers))
    for w, share in zip(workers, shares, strict=True):
        for index, _ in share:
            rows[index].worker = w.name
    ctx = multiprocessing.get_context("spawn")
    procs: list = []
    readers: dict = {}  # read end of each worker's pipe -> worker number
    ready: dict = {}  # worker number -> (validators, results path)
    finished: set = set()
    crashed: dict = {}  # worker number -> (error, traceback)
    done = [0] * len(workers)
    try:
        for i, w in enumerate(workers):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=target, name=f"anygpu-tune-{w.name}",
                            args=(i, w, backend_name, settings, cpu_threads, shares[i], writer))
            p.start()
            writer.close()  # the worker holds the only write end now: EOF when it exits, however it exits
            procs.append(p)
            readers[reader] = i
        while readers:
            for reader in multiprocessing.connection.wait(list(readers)):
                try:
                    message = reader.recv()
                except EOFError:
                    del readers[reader]
                    reader.close()
                    continue
                kind, number = message[0], message[1]
                if kind == "ready":
                    ready[number] = (message[2], message[3])
                elif kind == "item":
                    _record(rows, message[2], workers[number].name, message[3], message[4], failures)
                    done[number] += 1
                    bar.update()
                elif kind == "save_errors":
                    write_errors.update(message[2])
                elif kind == "finished":
                    finished.add(number)
                elif kind == "crashed":
                    crashed[number] = (message[2], message[3])
    finally:
        for p in procs:
            if p.is_alive() and readers:  # only on an interrupt or an error here: otherwise every worker has ended
                p.terminate()
            p.join()
        for reader in readers:
            reader.close()
    for i, (w, p) in enumerate(zip(workers, procs, strict=True)):
        if i in finished and p.exitcode == 0:
            continue
        why = f"the worker failed: {crashed[i][0]}" if i in crashed else f"the worker exited with code {p.exitcode}"
        failures.append(f"{w.name}: {why}, after {done[i]} of {len(shares[i])} GEMMs")
        if i in crashed:
            failures.append(crashed[i][1].rstrip())
    for row in rows:
        if row.solution is None and row.error is None:
            row.error = "not tuned: its worker stopped"
    return _share(rows, workers, ready, write_errors)


def _share(rows: list, workers: list, ready: dict, write_errors: dict | None = None) -> list:
    """Merge each worker's entries into the files of the workers with identical validators; the files."""
    number = {w.name: i for i, w in enumerate(workers)}
    groups: dict = {}  # validators, as sorted items -> ({path: None}, [entries])
    for validators, path in ready.values():
        groups.setdefault(tuple(sorted(validators.items())), ({}, []))[0][path] = None
    for row in rows:
        n = number.get(row.worker)
        if row.solution is not None and n in ready:
            groups[tuple(sorted(ready[n][0].items()))][1].append(
                results.Entry(row.work.op_signature, row.work.params_signature, row.solution, row.time_ms or 0.0))
    for key, (paths, entries) in groups.items():
        if len(paths) > 1 and entries:
            for path in paths:
                try:
                    results.merge_write(path, dict(key), entries)
                except OSError as e:
                    if write_errors is None:
                        raise
                    write_errors.setdefault(path, f"{path}: {e}")
    return sorted({path for _, path in ready.values()})
