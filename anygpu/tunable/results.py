"""The results file: PyTorch TunableOp's CSV lines, validators, and atomic merge-writes under a file lock.

Format (PyTorch's, so either tool reads the other's files)::

    Validator,ANYGPU_VERSION,0.1.0
    Validator,PT_VERSION,2.13.0+cpu
    GemmTunableOp_BFloat16_TN,tn_10240_8_8192_ld_8192_8192_10240,Default,0.0490157

``op_signature,params_signature,solution[,time_ms[,anything]]``; 3 fields mean time 0, empty lines are
skipped, order is irrelevant, and on a duplicate key the first line wins (PyTorch's rules).

Validation: our files carry ``ANYGPU_VERSION`` and must match our validators exactly (same keys, same
values).  A file without it was written by PyTorch: only the keys we can check (``PT_VERSION`` against
torch's version without its local suffix, ``GCN_ARCH_NAME``, ``ROCBLAS_VERSION``, ``HIPBLASLT_VERSION``,
``HIP_VERSION``) are compared.  A mismatch never raises: the file is ignored with a warning naming the
key and both values.  An unparsable line is skipped with a warning.

Writes are merges: under an exclusive advisory lock on ``<file>.lock`` (``fcntl.flock``; on Windows
``msvcrt.locking`` on the lock file's first byte), read what is on disk, add the new entries, write a
temporary file in the same directory and ``os.replace`` it over the old one.  Readers never see a torn
file and concurrent tuners never lose each other's entries.  A file whose validators do not match ours
is moved aside to ``<file>.stale`` (with a warning) before we start a new one.  On Windows ``os.replace``
fails while another process has the file open; readers here open it only briefly, and a failed write
warns instead of raising (the results stay in memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import warnings

import torch

VALIDATOR = "Validator"
OUR_KEY = "ANYGPU_VERSION"


class ResultsWarning(UserWarning):
    """Something in a results file was ignored (mismatched validators, a bad line)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    op_signature: str  # "GemmTunableOp_Half_TN"
    params_signature: str  # "tn_8192_7_28672_ld_28672_28672_8192"
    solution: str  # "Default", "Blas_cublaslt", "Gemm_Rocblas_45475" (PyTorch's, run as Default here)
    time_ms: float = 0.0

    @property
    def key(self) -> tuple[str, str]:
        return self.op_signature, self.params_signature

    def line(self) -> str:
        return f"{self.op_signature},{self.params_signature},{self.solution},{self.time_ms:.6g}"


@dataclasses.dataclass
class ResultsFile:
    validators: dict
    entries: dict  # (op_signature, params_signature) -> Entry, first seen wins


def current_validators(ordinal: int = 0) -> dict:
    """Our validators for device ``ordinal``: what must match for a file's timings to still hold."""
    from .. import backend
    from .._version import __version__

    b = backend.current(ordinal if backend.is_gpu() else None)
    v = {OUR_KEY: __version__, "PT_VERSION": torch.__version__, "TRITON_VERSION": b.versions.get("triton", "none"),
         "BACKEND": b.name, "ARCH": b.raw_arch or b.arch, "DEVICE_NAME": b.device_name}
    if b.name == "cuda":
        v["CUDA_VERSION"] = str(torch.version.cuda)
    elif b.name == "rocm":
        v["HIP_VERSION"] = str(torch.version.hip)
        v["ROCBLAS_VERSION"] = b.versions.get("rocblas", "unknown")
        v["HIPBLASLT_VERSION"] = b.versions.get("hipblaslt", "unknown")
    return v


def parse(text: str, source: str = "<text>") -> ResultsFile:
    """Validators and entries of a results (or untuned) file; bad lines are skipped with a warning."""
    validators: dict = {}
    entries: dict = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        parts = line.split(",")
        if parts[0] == VALIDATOR and len(parts) >= 3:
            validators.setdefault(parts[1], ",".join(parts[2:]))
            continue
        entry = None
        if len(parts) >= 2 and parts[0] != VALIDATOR and all(parts[:2]):
            solution = parts[2] if len(parts) >= 3 and parts[2] else ""
            try:
                time_ms = float(parts[3]) if len(parts) >= 4 else 0.0
            except ValueError:
                time_ms = None
            if time_ms is not None:
                entry = Entry(parts[0], parts[1], solution, time_ms)
        if entry is None:
            warnings.warn(f"{source}:{number}: could not parse line {raw[:120]!r}; skipped", ResultsWarning,
                          stacklevel=2)
            continue
        entries.setdefault(entry.key, entry)
    return ResultsFile(validators, entries)


def mismatch(found: dict, expected: dict) -> str | None:
    """Why a file's validators rule it out, or None when its timings apply here."""
    if OUR_KEY in found:
        for key in sorted(expected.keys() | found.keys()):
            if key not in found:
                return f"validator {key} is required ({expected[key]!r}) but the file does not provide it"
            if key not in expected:
                return f"validator {key} is provided ({found[key]!r}) but this process does not produce it"
            if found[key] != expected[key]:
                return f"validator {key}: the file has {found[key]!r}, this process {expected[key]!r}"
        return None
    # A PyTorch TunableOp file: compare what we can.
    ours = {"PT_VERSION": torch.__version__.split("+")[0], "GCN_ARCH_NAME": expected.get("ARCH"),
            "ROCBLAS_VERSION": expected.get("ROCBLAS_VERSION"), "HIPBLASLT_VERSION": expected.get("HIPBLASLT_VERSION"),
            "HIP_VERSION": None}
    for key, value in found.items():
        if ours.get(key) is not None and value != ours[key]:
            return f"validator {key} (PyTorch TunableOp file): the file has {value!r}, this process {ours[key]!r}"
    return None


def read(path: str, expected: dict | None) -> ResultsFile | None:
    """The file's contents if it exists and its validators match ``expected`` (None: do not check)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"{path}: cannot read the tuning results ({e}); ignored", ResultsWarning, stacklevel=2)
        return None
    results = parse(text, path)
    if expected is not None:
        why = mismatch(results.validators, expected)
        if why:
            warnings.warn(f"{path}: ignoring the tuning results, {why}", ResultsWarning, stacklevel=2)
            return None
    return results


def format_file(validators: dict, entries) -> str:
    lines = [f"{VALIDATOR},{k},{v}" for k, v in sorted(validators.items())]
    lines += [e.line() for e in sorted(entries, key=lambda e: e.key)]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def locked(path: str):
    """An exclusive advisory lock on ``path + ".lock"`` (kept on disk: deleting it would race)."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl
        except ImportError:  # Windows
            import msvcrt

            while True:
                try:
                    msvcrt.locking(fd, msvcrt.LK_LOCK, 1)  # retries for ~10 s, then raises
                    break
                except OSError:
                    continue
            try:
                yield
            finally:
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; done once, at import (os.umask is process-wide)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and ``os.replace``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; a results file is shared data: the mode open() would give it.
        with contextlib.suppress(OSError, NotImplementedError):
            os.chmod(tmp, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def merge_write(path: str, validators: dict | None, new_entries) -> None:
    """Add ``new_entries`` to the file at ``path`` (creating it), keeping what other processes wrote.

    ``validators`` None: an untuned file (no validator lines, entries without solutions)."""
    new_entries = list(new_entries)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with locked(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResultsWarning)  # the reader already warned about bad lines
            on_disk = read(path, None)
        merged: dict = {}
        if on_disk is not None:
            why = mismatch(on_disk.validators, validators) if validators is not None else None
            if why:
                warnings.warn(f"{path}: moving the old tuning results to {path}.stale, {why}", ResultsWarning,
                              stacklevel=2)
                os.replace(path, path + ".stale")
            else:
                merged.update(on_disk.entries)
        for entry in new_entries:
            merged.setdefault(entry.key, entry)
        if validators is None:
            text = "".join(f"{e.op_signature},{e.params_signature}\n" for e in sorted(merged.values(), key=lambda e: e.key))
        else:
            text = format_file(validators, merged.values())
        atomic_write(path, text)
