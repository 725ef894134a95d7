"""Hub ids through the Hugging Face cache (issue 23, part 3): ``org/name``, ``org/name:TAG``, ``gguf_file``.

This machine has no network, so each test builds a cache the way huggingface_hub lays it out, under its own
HF_HOME in tmp_path: ``hub/models--org--name/{blobs/<sha>, refs/main, snapshots/<rev>/<file> -> ../../blobs/<sha>}``
and reads it through ``huggingface_hub.snapshot_download(local_files_only=True)``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

pytest.importorskip("huggingface_hub")

from anygpu.models import GGUFCheckpoint, HFCheckpoint, open_checkpoint  # noqa: E402
from anygpu.models.resolve import hf_cache_dir, resolve_model  # noqa: E402

from .test_gguf_types import _tensors, write_llama  # noqa: E402
from .test_models_hf_errors import make_folder  # noqa: E402

REV = "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(hub, repo: str, files: dict, rev: str = REV):
    """files: relative name -> bytes.  Blobs by content hash, snapshot entries as relative symlinks, refs/main."""
    root = hub / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(rev)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (root / "blobs" / sha).write_bytes(data)
        link = root / "snapshots" / rev / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(root / "blobs" / sha, link.parent))
    return root / "snapshots" / rev


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "hf" / "hub"
    path.mkdir(parents=True)
    assert hf_cache_dir() == path
    return path


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Two real files: the 'Q4_K_M' one in Q4_K (what most of a Q4_K_M file is), the other in Q8_0."""
    d = tmp_path_factory.mktemp("gguf")
    return {"Q4_K_M": open(write_llama(d / "a.gguf", _tensors("Q4_K", seed=7)), "rb").read(),
            "Q8_0": open(write_llama(d / "b.gguf", _tensors("Q8_0", seed=8)), "rb").read()}


def _folder_files(tmp_path):
    folder = make_folder(tmp_path / "src")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_folder_repo(hub, tmp_path):
    snapshot = add_to_cache(hub, "TinyOrg/tiny-llama", {**_folder_files(tmp_path), "README.md": b"# tiny"})
    assert resolve_model("TinyOrg/tiny-llama") == snapshot
    ckpt = open_checkpoint("TinyOrg/tiny-llama")
    assert isinstance(ckpt, HFCheckpoint) and ckpt.name == "TinyOrg/tiny-llama"
    assert ckpt.config.num_layers == 2 and len(dict(ckpt.weights(progress=False))) == 20


def test_gguf_repo_tags(hub, gguf_files):
    files = {"Tiny-Q4_K_M.gguf": gguf_files["Q4_K_M"], "Tiny-Q8_0.gguf": gguf_files["Q8_0"], "README.md": b"#"}
    snapshot = add_to_cache(hub, "TinyOrg/Tiny-GGUF", files)
    assert resolve_model("TinyOrg/Tiny-GGUF:Q8_0") == snapshot / "Tiny-Q8_0.gguf"
    assert resolve_model("TinyOrg/Tiny-GGUF:q4_k_m") == snapshot / "Tiny-Q4_K_M.gguf"  # case-insensitive
    assert resolve_model("TinyOrg/Tiny-GGUF") == snapshot / "Tiny-Q4_K_M.gguf"  # llama.cpp's default tag
    assert resolve_model("TinyOrg/Tiny-GGUF", gguf_file="Tiny-Q8_0.gguf") == snapshot / "Tiny-Q8_0.gguf"
    ckpt = open_checkpoint("TinyOrg/Tiny-GGUF:Q8_0")
    assert isinstance(ckpt, GGUFCheckpoint) and {t.type_name for t in ckpt.tensors} == {"Q8_0", "F32"}
    assert open_checkpoint("TinyOrg/Tiny-GGUF", gguf_file="Tiny-Q4_K_M.gguf").name == "Tiny-Q4_K_M.gguf"
    # Q4_K is not Q4_K_M: no file carries the bare tag
    with pytest.raises(FileNotFoundError, match=r"TinyOrg/Tiny-GGUF:Q4_K: no \.gguf file named with 'Q4_K' "
                                                r"\(\.gguf files: Tiny-Q4_K_M\.gguf, Tiny-Q8_0\.gguf\) in .*snapshots"):
        resolve_model("TinyOrg/Tiny-GGUF:Q4_K")
    with pytest.raises(FileNotFoundError, match=r"no file 'nope\.gguf' \(\.gguf files: Tiny-Q4_K_M"):
        resolve_model("TinyOrg/Tiny-GGUF", gguf_file="nope.gguf")
    with pytest.raises(ValueError, match="not both"):
        resolve_model("TinyOrg/Tiny-GGUF:Q8_0", gguf_file="Tiny-Q8_0.gguf")


def test_single_gguf_and_ambiguous_tag(hub, gguf_files):
    one = add_to_cache(hub, "TinyOrg/One-GGUF", {"only.Q8_0.gguf": gguf_files["Q8_0"]})
    assert resolve_model("TinyOrg/One-GGUF") == one / "only.Q8_0.gguf"
    add_to_cache(hub, "TinyOrg/Split-GGUF", {"m-Q8_0-00001-of-00002.gguf": b"x", "m-Q8_0-00002-of-00002.gguf": b"y"})
    with pytest.raises(FileNotFoundError, match=r"2 \.gguf files named with 'Q8_0'.*split GGUFs are not supported"):
        resolve_model("TinyOrg/Split-GGUF:Q8_0")


def test_engine_runs_a_hub_id(hub, gguf_files):
    from anygpu.engine import LLMEngine, SamplingParams

    add_to_cache(hub, "TinyOrg/Tiny-GGUF", {"Tiny-Q8_0.gguf": gguf_files["Q8_0"]})
    engine = LLMEngine("TinyOrg/Tiny-GGUF:Q8_0", progress=False, max_model_len=64)
    assert engine.model_name == "Tiny-Q8_0.gguf" and engine.model_path.name == "Tiny-Q8_0.gguf"
    engine.add_request("r", [256, 72, 105], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        out = engine.step()
    assert len(out[0].token_ids) == 4


def test_not_in_cache(hub):
    with pytest.raises(FileNotFoundError) as e:
        open_checkpoint("SomeOrg/missing-model")
    msg = str(e.value)
    assert "SomeOrg/missing-model: not a local file or folder, and not in the Hugging Face cache" in msg
    assert str(hub) in msg and "models--SomeOrg--missing-model/snapshots" in msg and "HF_HUB_OFFLINE" in msg
    # a cached repo without refs/main (a partial download): the same, naming where it looked
    (hub / "models--SomeOrg--partial" / "snapshots").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"SomeOrg/partial: .*models--SomeOrg--partial/snapshots"):
        open_checkpoint("SomeOrg/partial")


def test_not_a_hub_id(tmp_path):
    for spec in (str(tmp_path / "nope.gguf"), "./rel/nope", "no-slash"):
        with pytest.raises(FileNotFoundError, match="no such file or folder"):
            open_checkpoint(spec)


def test_unreachable_hub_falls_back_to_the_cache(tmp_path, gguf_files):
    """Not offline, but the Hub does not answer (a closed local port as its endpoint): the cache answers.  In a
    subprocess: huggingface_hub reads HF_ENDPOINT and the offline flag once, at import."""
    hub = tmp_path / "hf" / "hub"
    snapshot = add_to_cache(hub, "TinyOrg/Tiny-GGUF", {"Tiny-Q8_0.gguf": gguf_files["Q8_0"]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2",
               HF_HUB_DOWNLOAD_TIMEOUT="2")
    code = ("from anygpu.models.resolve import resolve_model; print(resolve_model('TinyOrg/Tiny-GGUF:Q8_0')); "
            "resolve_model('TinyOrg/absent')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == str(snapshot / "Tiny-Q8_0.gguf"), proc.stderr
    assert "TinyOrg/absent: not a local file or folder, and not in the Hugging Face cache" in proc.stderr
    assert "the Hub could not be reached" in proc.stderr
