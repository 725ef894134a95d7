"""``--gguf-file FILE`` with ``--model`` (a folder or a Hub repo in the Hugging Face cache) for ``anygpu generate``,
``chat``, ``serve`` and ``bench model`` (issue 23, part 3), in a real subprocess of the CLI, on a cache the test
builds (``test_hub_resolve.add_to_cache``: no network here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("huggingface_hub")

from .test_gguf_types import _tensors, write_llama  # noqa: E402
from .test_hub_resolve import add_to_cache  # noqa: E402

REPO = "TinyOrg/Tiny-GGUF"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An HF_HOME whose hub cache holds REPO with two GGUFs, and a plain folder with the same two files."""
    root = tmp_path_factory.mktemp("hf")
    files = {"Tiny-Q8_0.gguf": write_llama(root / "b.gguf", _tensors("Q8_0", seed=8)),
             "Tiny-Q4_0.gguf": write_llama(root / "a.gguf", _tensors("Q4_0", seed=7))}
    data = {name: open(path, "rb").read() for name, path in files.items()}
    snapshot = add_to_cache(root / "home" / "hub", REPO, data)
    folder = root / "folder"
    folder.mkdir()
    for name, blob in data.items():
        (folder / name).write_bytes(blob)
    return root / "home", snapshot, folder


def cli(home, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "anygpu.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_generate_with_gguf_file_from_the_cache(cache):
    home, snapshot, _ = cache
    proc = cli(home, "generate", "--model", REPO, "--gguf-file", "Tiny-Q8_0.gguf", "--raw", "--max-tokens", "3",
               "--max-model-len", "64", "hi")
    assert proc.returncode == 0, proc.stderr
    assert "generated_tokens=3" in proc.stderr


def test_generate_with_gguf_file_in_a_folder(cache):
    home, _, folder = cache
    proc = cli(home, "generate", "--model", str(folder), "--gguf-file", "Tiny-Q4_0.gguf", "--raw", "--max-tokens",
               "2", "--max-model-len", "64", "hi")
    assert proc.returncode == 0, proc.stderr
    assert "generated_tokens=2" in proc.stderr


def test_errors_say_what_was_looked_for_and_where(cache):
    home, snapshot, folder = cache
    proc = cli(home, "generate", "--model", REPO, "--gguf-file", "nope.gguf", "hi")
    assert proc.returncode == 1
    assert "no file 'nope.gguf' (.gguf files: Tiny-Q4_0.gguf, Tiny-Q8_0.gguf)" in proc.stderr
    assert str(snapshot) in proc.stderr
    proc = cli(home, "chat", "--model", "TinyOrg/Absent", "--gguf-file", "x.gguf")
    assert proc.returncode == 1
    assert "TinyOrg/Absent: not a local file or folder, and not in the Hugging Face cache" in proc.stderr
    assert str(home / "hub") in proc.stderr and "models--TinyOrg--Absent" in proc.stderr
    proc = cli(home, "serve", "--model", str(folder), "--gguf-file", "missing.gguf", "--port", "0")
    assert proc.returncode == 1 and f"{folder / 'missing.gguf'}: no such file" in proc.stderr
    proc = cli(home, "bench", "model", "--gguf-file", "Tiny-Q8_0.gguf")
    assert proc.returncode == 2 and "--gguf-file names a file inside --model" in proc.stderr
    proc = cli(home, "generate", "--model", f"{REPO}:Q8_0", "--gguf-file", "Tiny-Q8_0.gguf", "hi")
    assert proc.returncode == 1 and "give a :Q8_0 tag or gguf_file (Tiny-Q8_0.gguf), not both" in proc.stderr


def test_bench_model_with_gguf_file(cache, tmp_path):
    home, _, _ = cache
    out = tmp_path / "model.json"
    proc = cli(home, "bench", "model", "--model", REPO, "--gguf-file", "Tiny-Q8_0.gguf", "--num-prompts", "2",
               "--input-len", "4", "--output-len", "2", "--no-baseline", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Tiny-Q8_0.gguf" in out.read_text()
