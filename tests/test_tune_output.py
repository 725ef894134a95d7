"""``anygpu tune`` when the results file cannot be written (issue 21, item 10): it printed "results in FILE" and
exited 0.  Now: exit status 1, an error naming --output and the OS error, no "results in" that file, and no
half-written or temporary file left (the write is a temporary file in the same folder, then os.replace).

Run as the real command in a subprocess, on the CPU backend, against real unwritable targets.
"""

import os
import shutil
import subprocess
import sys

import pytest


def _tune(output, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANYGPU_TUNABLEOP_")}
    env.update(ANYGPU_BACKEND="cpu", TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "anygpu.cli", "tune", "--shape", "1,8,8", "--dtype", "fp32",
                           "--max-iterations", "2", "--max-duration-ms", "1", "--output", str(output)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def _no_temporaries(folder):
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_output_is_a_directory(tmp_path):
    (tmp_path / "r0.csv").mkdir()  # "r.csv" gets the device ordinal: r0.csv, which is a directory
    r = _tune(tmp_path / "r.csv", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"error: --output: cannot write the results: {tmp_path / 'r0.csv'}: [Errno 21] Is a directory" in r.stderr
    assert "results in (nothing written)" in r.stdout
    assert os.listdir(tmp_path / "r0.csv") == []
    _no_temporaries(tmp_path)


def test_output_under_a_file(tmp_path):
    (tmp_path / "plain").write_text("keep me")
    r = _tune(tmp_path / "plain" / "r%d.csv", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"error: --output: cannot write the results: {tmp_path / 'plain' / 'r0.csv'}:" in r.stderr
    assert (tmp_path / "plain").read_text() == "keep me"


def test_immutable_output_file_is_left_as_it_was(tmp_path):
    target = tmp_path / "r0.csv"
    target.write_text("old contents\n")
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(target)]).returncode:
        pytest.skip("chattr +i is not available here (needs root and a file system with attributes)")
    try:
        r = _tune(tmp_path / "r%d.csv", tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"error: --output: cannot write the results: {target}: [Errno 1] Operation not permitted" in r.stderr
        assert target.read_text() == "old contents\n"
        _no_temporaries(tmp_path)
    finally:
        subprocess.run(["chattr", "-i", str(target)])


def test_a_good_output_still_exits_0(tmp_path):
    r = _tune(tmp_path / "r%d.csv", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"results in {tmp_path / 'r0.csv'}" in r.stdout
    assert "GemmTunableOp_float_TN,tn_8_1_8_ld_8_8_8," in (tmp_path / "r0.csv").read_text()
    _no_temporaries(tmp_path)
