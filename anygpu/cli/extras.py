"""The optional parts of anygpu and the extra that installs each (pyproject.toml's optional-dependencies).

The core install (``pip install anygpu``) is quantization, the optimizers, the ops and kernels, TunableOp,
``anygpu doctor`` and ``anygpu tune``.  A command that needs more checks for its extra before it does anything,
so that a user without it reads the install line instead of a ModuleNotFoundError from deep inside an import.
"""

from __future__ import annotations

import importlib.util

import click

# The modules of each extra (import names) that its commands cannot start without.  llguidance (llm) is left
# out: only a request for guided decoding imports it.
EXTRAS = {
    # The engine: GGUF and Hugging Face checkpoints, tokenizers, chat templates, Hub ids.
    "llm": ("gguf", "tokenizers", "jinja2", "huggingface_hub"),
    # The HTTP server and its load generator, on top of the engine.
    "serve": ("gguf", "tokenizers", "jinja2", "huggingface_hub", "fastapi", "uvicorn", "httptools",
              "prometheus_client", "httpx"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, command: str) -> None:
    """Stop ``command`` with the install line when a module of ``extra`` is missing."""
    gone = missing(extra)
    if gone:
        raise click.ClickException(f'`{command}` needs the "{extra}" extra ({", ".join(gone)} not installed): '
                                   f'pip install "anygpu[{extra}]"')
