"""``anygpu serve`` as a user runs it: a real process, found through the address it prints, stopped with SIGINT."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")


def start(*args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "anygpu.cli", "serve", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        m = re.search(r"serving '.*' on (http://\S+) ", line)
        if m:
            url = m.group(1)
            while True:  # the line comes before uvicorn listens: wait for /health
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        return proc, url, lines
                except httpx.TransportError:
                    time.sleep(0.05)
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines) + (proc.stderr.read() or ""))


def stop(proc) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_random_model_with_key_and_stop():
    proc, url, _ = start("--random-config", "tiny", "--port", "0", "--api-key", "k1", "--max-num-seqs", "4")
    try:
        assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
        client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        r = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == 3
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        assert stop(proc) == 0


def test_busy_port_and_bad_arguments_are_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "anygpu.cli", "serve", "--random-config", "tiny", "--port",
                            str(port)], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "--port" in r.stderr and str(port) in r.stderr
    r = subprocess.run([sys.executable, "-m", "anygpu.cli", "serve", "--random-config", "tiny", "--tp", "3",
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "tp: 3" in r.stderr
    r = subprocess.run([sys.executable, "-m", "anygpu.cli", "serve", "--random-config", "nope", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "random_config" in r.stderr


def test_listening_beyond_loopback_without_a_key_warns():
    proc, url, lines = start("--random-config", "tiny", "--host", "0.0.0.0", "--port", "0")
    try:
        assert any("without --api-key" in line for line in lines)
    finally:
        stop(proc)


def test_tp2_server_answers_as_tp1():
    """``--tp 2`` on the CPU: a second process over gloo holds half of every layer; the tokens are TP=1's."""
    body = {"model": "tiny", "prompt": [100, 200, 300, 400], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    texts = []
    for tp in ("1", "2"):
        proc, url, _ = start("--random-config", "tiny", "--port", "0", "--tp", tp, "--max-num-seqs", "4")
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        finally:
            assert stop(proc) == 0
    assert texts[0] == texts[1] and len(texts[0].split()) == 12


def _engine_child(pid: int) -> int:
    """The engine process ``anygpu serve`` spawned (multiprocessing's spawn_main), found through /proc."""
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"no engine process under {pid}")


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="finds the engine process through /proc")
def test_server_exits_nonzero_when_its_engine_dies():
    """Issue 21: a dead engine made the server answer 503 forever; now it stops, says why, and exits 1."""
    proc, url, _ = start("--random-config", "tiny", "--port", "0", "--max-num-seqs", "4")
    try:
        os.kill(_engine_child(proc.pid), signal.SIGKILL)
        code = proc.wait(timeout=30)
        err = proc.stderr.read()
        assert code == 1 and "the engine has died" in err and "supervisor" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("env,args,expected", [
    ({"ANYGPU_API_KEY": ""}, [], "ANYGPU_API_KEY"),
    ({"ANYGPU_API_KEY": "  "}, [], "ANYGPU_API_KEY"),
    ({}, ["--api-key", "clé"], "printable ASCII"),
    ({}, ["--api-key", "a b"], "printable ASCII"),
    ({"ANYGPU_API_KEY": "k\x01"}, [], "printable ASCII"),
])
def test_unusable_api_keys_are_refused(env, args, expected):
    """Issue 21 item 8: a non-ASCII key could never match, and an empty ANYGPU_API_KEY started an open server."""
    r = subprocess.run([sys.executable, "-m", "anygpu.cli", "serve", "--random-config", "tiny", "--port", "0",
                        *args], capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if k != "ANYGPU_API_KEY"}, **env})
    assert r.returncode == 2 and "--api-key" in r.stderr and expected in r.stderr, r.stderr
    assert "serving" not in r.stderr
