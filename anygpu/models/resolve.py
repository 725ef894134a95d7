"""``resolve_model(spec, gguf_file=None) -> Path``: a local path, or a Hugging Face Hub id through the HF cache.

    resolve_model("path/to/folder")                      # a local file or folder: itself
    resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")  # the snapshot folder in the HF cache
    resolve_model("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")        # the .gguf whose name carries the tag
    resolve_model("bartowski/Llama-3.2-1B-Instruct-GGUF", gguf_file="Llama-3.2-1B-Instruct-Q6_K.gguf")

Hub ids go through ``huggingface_hub``: the cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the library's
default, read at call time (so a process that changes them, as the tests do, is followed).  With
``HF_HUB_OFFLINE=1`` only the cache is read (``local_files_only``); otherwise the Hub is asked first and, if it
cannot be reached, the cache answers.  Online, only what the engine reads is fetched: one .gguf file of a GGUF repo,
the config, tokenizer and safetensors files of a model folder.  The ``:TAG`` form is llama.cpp's: the file whose
name holds TAG (case-insensitive, not as part of a longer name: Q4_K does not pick Q4_K_M); with no tag, a repo
holding .gguf files and no config.json gives its only .gguf, else its Q4_K_M one (llama.cpp's default).  Every
error says what was looked for and where.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?::(?P<tag>[\w.-]+))?")
DEFAULT_TAG = "Q4_K_M"
# What an HF model folder needs (HFCheckpoint): config, weights, tokenizer, chat template.
FOLDER_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
_TRUE = {"1", "on", "yes", "true"}


def hf_cache_dir() -> Path:
    """The hub cache, as huggingface_hub would pick it now (its constants are read at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def is_hub_id(spec: str) -> bool:
    return HUB_ID.fullmatch(spec) is not None and not spec.startswith((".", "/", "~"))


def resolve_model(spec: str | Path, gguf_file: str | None = None) -> Path:
    """``spec`` as a local path when it exists, else as a Hub id (``org/name`` or ``org/name:TAG``)."""
    path = Path(spec).expanduser()
    if path.exists():
        if gguf_file is None:
            return path
        if not path.is_dir():
            raise ValueError(f"{path}: gguf_file ({gguf_file}) names a file inside a folder, but this is a file")
        found = path / gguf_file
        if not found.is_file():
            raise FileNotFoundError(f"{found}: no such file (gguf_file {gguf_file!r} in {path})")
        return found
    if not isinstance(spec, str) or not is_hub_id(spec):
        raise FileNotFoundError(f"{path}: no such file or folder (and not a Hugging Face Hub id, org/name)")
    m = HUB_ID.fullmatch(spec)
    repo, tag = m.group("repo"), m.group("tag")
    if tag and gguf_file:
        raise ValueError(f"{spec}: give a :{tag} tag or gguf_file ({gguf_file}), not both")
    return _resolve_hub(spec, repo, tag, gguf_file)


def _resolve_hub(spec: str, repo: str, tag: str | None, gguf_file: str | None) -> Path:
    cache = hf_cache_dir()
    where = f"the Hugging Face cache {cache}"
    if not hf_offline():
        try:
            return _online(repo, tag, gguf_file, cache)
        except (_NotOnHub, _NoMatch) as e:
            raise FileNotFoundError(f"{spec}: {e}") from None
        except Exception as e:  # no network, a proxy, a timeout: the cache may still hold it
            where += f" (the Hub could not be reached: {type(e).__name__})"
    snapshot = _cached_snapshot(spec, repo, cache, where)
    files = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
    try:
        chosen = _choose(repo, files, tag, gguf_file)
    except _NoMatch as e:
        raise FileNotFoundError(f"{spec}: {e} in {snapshot}") from None
    return snapshot / chosen if chosen else snapshot


def _cached_snapshot(spec: str, repo: str, cache: Path, where: str) -> Path:
    from huggingface_hub import snapshot_download

    expected = cache / ("models--" + repo.replace("/", "--")) / "snapshots"
    try:
        return Path(snapshot_download(repo, cache_dir=cache, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError and friends: say what was looked for, and where
        offline = " (HF_HUB_OFFLINE is set)" if hf_offline() else ""
        raise FileNotFoundError(f"{spec}: not a local file or folder, and not in {where}{offline}: looked for "
                                f"{expected}/<the revision in refs/main> ({type(e).__name__})") from None


def _online(repo: str, tag: str | None, gguf_file: str | None, cache: Path) -> Path:
    from huggingface_hub import hf_hub_download, model_info, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    # model_info, not list_repo_files: the latter retries a refused connection for half a minute.
    try:
        info = model_info(repo)
    except GatedRepoError:
        raise _NotOnHub("a gated repository: accept its terms on the Hub and log in (HF_TOKEN or `hf auth "
                        "login`)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise _NotOnHub(f"no such model repository on the Hugging Face Hub ({type(e).__name__})") from None
    files = sorted(s.rfilename for s in info.siblings or ())
    try:
        chosen = _choose(repo, files, tag, gguf_file)
    except _NoMatch as e:
        raise _NoMatch(f"{e} on the Hugging Face Hub") from None
    if chosen:
        return Path(hf_hub_download(repo, chosen, revision=info.sha, cache_dir=cache))
    return Path(snapshot_download(repo, revision=info.sha, cache_dir=cache, allow_patterns=FOLDER_PATTERNS))


def _choose(repo: str, files: list[str], tag: str | None, gguf_file: str | None) -> str | None:
    """The .gguf file to use among the repo's ``files`` (relative names), or None for the folder itself."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if gguf_file:
        if gguf_file in files:
            return gguf_file
        raise _NoMatch(f"no file {gguf_file!r} (.gguf files: {_listing(ggufs)})")
    if tag is None:
        if "config.json" in files or not ggufs:
            return None
        if len(ggufs) == 1:
            return ggufs[0]
        tag = DEFAULT_TAG
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matches = [f for f in ggufs if pattern.search(Path(f).name)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise _NoMatch(f"no .gguf file named with {tag!r} (.gguf files: {_listing(ggufs)})")
    raise _NoMatch(f"{len(matches)} .gguf files named with {tag!r} ({_listing(matches)}); pick one with gguf_file "
                   "(split GGUFs are not supported)")


def _listing(names: list[str], limit: int = 12) -> str:
    if not names:
        return "none"
    more = f", ... {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class _NoMatch(Exception):
    pass


class _NotOnHub(Exception):
    pass
