"""The files of a model folder: JSON read with a size bound and errors that name the file, and the rule for which
names a folder's own files (``model.safetensors.index.json``) may point to.

    cfg = read_json(folder / "config.json")                       # ValueError "<path>: not valid JSON (...)"
    shard = file_in_folder(folder, "model-00001.safetensors", where=index_path)

The rule (decided for the Hugging Face cache): a name written inside a model folder must be a relative path
without ``..`` (and not absolute, no backslash, no NUL), so it names a file under the folder *as written*.
Symlinks are then followed, not resolved and compared: the Hugging Face cache keeps ``snapshots/<rev>/x`` as a
symlink to ``blobs/<sha>`` outside the snapshot folder, and refusing that would refuse every downloaded model.
A symlink was put there by whoever wrote the folder (who could as well have copied the file in); a name inside
a JSON file is data, and ``"../other/model.safetensors"`` must not reach another folder through it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

# config.json, generation_config.json, tokenizer_config.json and the index are kilobytes (a 100k-tensor index is
# ~10 MB); a tokenizer.json is up to ~35 MB for the largest vocabularies.  Bounds well above both.
MAX_JSON_BYTES = 64 << 20
MAX_TOKENIZER_BYTES = 512 << 20


def check_size(path: Path, max_bytes: int) -> None:
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path}: {size} bytes, over the {max_bytes}-byte limit for this file (a corrupt or wrong "
                         "file)")


def read_json(path: str | Path, max_bytes: int = MAX_JSON_BYTES, expect: type = dict):
    """The JSON value of ``path``, which must be a ``expect`` (a JSON object by default).  ValueError naming the
    file for one too big, not UTF-8, not JSON, or of the wrong type."""
    path = Path(path)
    check_size(path, max_bytes)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; absurd nesting a RecursionError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, expect):
        kind = "a JSON object" if expect is dict else expect.__name__
        raise ValueError(f"{path}: expected {kind}, got {type(value).__name__}")
    return value


def file_in_folder(folder: Path, name, where: str) -> Path:
    """``folder / name`` for a ``name`` read from a file of the folder (``where``), refused unless it is a plain
    relative path under the folder (the rule in this module's docstring)."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise ValueError(f"{where}: expected a file name inside the model folder, got {name!r}")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or os.path.isabs(name) or os.path.splitdrive(name)[0]:
        raise ValueError(f"{where}: {name!r} is outside the model folder {folder}; a model folder may only name "
                         "files inside itself (a relative path without '..')")
    return folder / pure
