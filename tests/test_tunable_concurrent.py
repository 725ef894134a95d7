"""8 processes tuning into one results file at once: every entry ends up there and no line is torn."""

import multiprocessing
import sys

import pytest

from anygpu.tunable import results

PROCESSES = 8
ENTRIES_EACH = 15
VALIDATORS = {"ANYGPU_VERSION": "test", "PT_VERSION": "test"}


def _writer(path: str, worker: int, start) -> None:
    start.wait()
    for i in range(ENTRIES_EACH):  # one merge-write per result, as realtime tuning does
        entry = results.Entry("GemmTunableOp_Half_TN", f"tn_{worker + 1}_{i + 1}_64_ld_64_64_{worker + 1}",
                              f"Solution_{worker}_{i}", 0.001 * (i + 1))
        results.merge_write(path, VALIDATORS, [entry])


@pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only; the lock itself has a Windows path")
def test_eight_processes_writing_concurrently_lose_nothing(tmp_path):
    path = str(tmp_path / "results0.csv")
    ctx = multiprocessing.get_context("fork")  # the children touch only files: safe, and no torch re-import
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(path, w, start)) for w in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    lines = (tmp_path / "results0.csv").read_text().splitlines()
    validator_lines = [line for line in lines if line.startswith("Validator,")]
    result_lines = [line for line in lines if not line.startswith("Validator,")]
    assert sorted(validator_lines) == sorted(f"Validator,{k},{v}" for k, v in VALIDATORS.items())
    assert all(len(line.split(",")) == 4 for line in result_lines), "torn line"
    expected = {f"tn_{w + 1}_{i + 1}_64_ld_64_64_{w + 1}" for w in range(PROCESSES) for i in range(ENTRIES_EACH)}
    assert {line.split(",")[1] for line in result_lines} == expected
    assert len(result_lines) == PROCESSES * ENTRIES_EACH
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


def _tuner(path: str, worker: int, start) -> None:
    import torch

    from anygpu import tunable

    tunable.controls.set(filename=path, insert_device_ordinal=False, max_tuning_iterations=2,
                         max_tuning_duration_ms=1, rotating_buffer_size_mb=0)
    start.wait()
    for k in (16, 32):  # two shapes of its own per process, tuned through the public entry point
        tunable.linear(torch.randn(worker + 1, k), torch.randn(8, k))


def test_eight_processes_tuning_through_tunable_linear_lose_nothing(tmp_path):
    path = str(tmp_path / "results.csv")
    ctx = multiprocessing.get_context("spawn")  # real tuning runs torch: a fresh interpreter per process
    start = ctx.Event()
    procs = [ctx.Process(target=_tuner, args=(path, w, start)) for w in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    found = results.read(path, results.current_validators(0))
    expected = {("GemmTunableOp_float_TN", f"tn_8_{w + 1}_{k}_ld_{k}_{k}_8") for w in range(PROCESSES) for k in (16, 32)}
    assert set(found.entries) == expected


def test_results_file_gets_the_usual_file_mode(tmp_path):
    import os
    import stat

    from anygpu.tunable import results

    path = tmp_path / "r.csv"
    results.atomic_write(str(path), "x\n")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
