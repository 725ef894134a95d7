"""``anygpu serve``'s issue-24 flags in a real process: the access log is on by default (``--no-access-log``
turns it off), ``--served-model-name`` takes repeated and comma-listed aliases, ``--strict-model-name`` gives
OpenAI's 404 for any other name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx

from .test_cli_serve import stop


def start(log, *args):
    """``anygpu serve ARGS`` with its stdout (where uvicorn writes the access log) in the file ``log``; returns
    (process, url) once /health answers (test_cli_serve.start, which drops stdout, otherwise)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "anygpu.cli", "serve", *args], stderr=subprocess.PIPE,
                                stdout=out, text=True, env=env)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        m = re.search(r"serving '.*' on (http://\S+) ", line)
        if m:
            while True:
                try:
                    if httpx.get(m.group(1) + "/health", timeout=1).status_code == 200:
                        return proc, m.group(1)
                except httpx.TransportError:
                    time.sleep(0.05)
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines))


def test_access_log_on_by_default_with_aliases(tmp_path):
    log = tmp_path / "stdout.log"
    proc, url = start(log, "--random-config", "tiny", "--port", "0", "--served-model-name", "a,b",
                         "--served-model-name", "c", "--max-num-seqs", "2")
    try:
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["a", "b", "c"]
        r = httpx.post(url + "/v1/completions", json={"model": "zzz", "prompt": "w1 w2", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "a"  # not strict: any name is the one model
    finally:
        assert stop(proc) == 0
    text = log.read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in text and '"GET /v1/models HTTP/1.1" 200' in text, text


def test_no_access_log_and_strict_names(tmp_path):
    log = tmp_path / "stdout.log"
    proc, url = start(log, "--random-config", "tiny", "--port", "0", "--no-access-log", "--strict-model-name",
                         "--max-num-seqs", "2")
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "zzz", "prompt": "w1 w2", "max_tokens": 2}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        ok = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200
    finally:
        assert stop(proc) == 0
    assert "HTTP/1.1" not in log.read_text() + proc.stderr.read()
