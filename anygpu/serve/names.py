"""The names a served model answers to, and the policy for the ``model`` field of a request.

The default name is the model's own, as people call it, not its file: a GGUF's ``general.name``, an HF folder's
repo id when it sits in the Hugging Face cache (``models--org--name/snapshots/<sha>`` -> ``org/name``), else
the folder's name; random weights keep the engine's name (the config's).  ``--served-model-name`` replaces it
with one or more aliases; the first is the one the server reports (``/v1/models`` lists them all).

Policy (one model per server): a request without ``model`` means the served model, as in TGI and llama.cpp.
A name the server does not know is accepted as well by default, as TGI does (its own clients send ``"tgi"``,
Hugging Face's ``InferenceClient`` sends ``"dummy"`` when pointed at a URL); ``strict=True``
(``--strict-model-name``) answers it with OpenAI's 404 ``model_not_found``, as vLLM does.
"""

from __future__ import annotations

from pathlib import Path

from .errors import APIError


def default_model_name(engine) -> str:
    path = getattr(engine, "model_path", None)
    if path is None:
        return engine.model_name
    path = Path(path)
    if path.is_file():
        return _gguf_name(path) or path.stem
    parts = path.resolve().parts
    # The Hugging Face cache: .../models--org--name/snapshots/<sha>
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return path.resolve().name


def _gguf_name(path: Path) -> str | None:
    """``general.name`` from a GGUF's header (the file is memory-mapped, its tensors are not read)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path, "r").fields.get("general.name")
        name = field.contents() if field is not None else None
    except Exception:  # the engine has loaded this file: a header it could read but not this is no reason to fail
        return None
    return name.strip() if isinstance(name, str) and name.strip() else None


def parse_names(value) -> list[str]:
    """``--served-model-name`` values: a string, or a list of them, each possibly a comma list."""
    values = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(v, str) for v in values):
        raise ValueError(f"model_name: expected a string or a list of strings, got {value!r}")
    names = [n.strip() for v in values for n in v.split(",")]
    if not names or any(not n for n in names):
        raise ValueError(f"model_name: expected non-empty names (a comma list or several values), got {value!r}")
    return list(dict.fromkeys(names))  # duplicates once, in order


class ModelNames:
    def __init__(self, names: list[str], strict: bool):
        self.names, self.strict = names, strict
        self.primary = names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to answer with for a request's ``model`` (None: absent), or 404 when strict and unknown."""
        if requested is None:
            return self.primary
        if requested in self.names:
            return requested
        if self.strict:
            served = ", ".join(repr(n) for n in self.names)
            raise APIError(404, f"model: {requested!r} does not exist; this server serves {served}", "model",
                           "model_not_found")
        return self.primary
