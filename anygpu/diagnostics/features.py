"""Which optional parts of anygpu this install can run, and the extra (pyproject.toml's optional-dependencies)
that installs each: what ``anygpu doctor`` lists under "features", and what a command checks before it starts
(``cli/extras.py``), so that a user without an extra reads the install line instead of a ModuleNotFoundError.

The core install is quantization, the optimizers, the ops, TunableOp, ``anygpu doctor`` and ``anygpu tune``.
"""

from __future__ import annotations

import importlib.util

# The modules of each extra (import names) that its commands cannot start without.  llguidance (llm) is left
# out: only a request for guided decoding imports it (a feature line of its own below).
EXTRAS = {
    # The engine: GGUF and Hugging Face checkpoints, tokenizers, chat templates, Hub ids.
    "llm": ("gguf", "tokenizers", "jinja2", "huggingface_hub"),
    # The HTTP server and its load generator, on top of the engine.
    "serve": ("gguf", "tokenizers", "jinja2", "huggingface_hub", "fastapi", "uvicorn", "httptools",
              "prometheus_client", "httpx"),
}

# (feature, the modules it needs, how to get them, what happens without them)
FEATURES = (
    ("Triton kernels (GPUs; the interpreter on the CPU)", ("triton",), "pip install triton (CUDA and ROCm torch "
     "wheels bring it)", "every op runs its PyTorch reference"),
    ("engine: anygpu generate, chat, bench model", EXTRAS["llm"], 'pip install "anygpu[llm]"', "off"),
    ("structured output (response_format, guided_json)", ("llguidance",), 'pip install "anygpu[llm]"',
     "such requests are refused"),
    ("server: anygpu serve, bench serve", EXTRAS["serve"], 'pip install "anygpu[serve]"', "off"),
    ("bitsandbytes' ops on anygpu's kernels (anygpu.integrations.bitsandbytes)", ("bitsandbytes",),
     "pip install bitsandbytes", "nothing to integrate with (anygpu's own bitsandbytes-format API works alone)"),
)


def missing(modules) -> list[str]:
    """The modules that cannot be imported here."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def features() -> list[dict]:
    """Each optional feature: on or off, and what is missing and how to get it."""
    out = []
    for name, modules, install, without in FEATURES:
        gone = missing(modules)
        out.append({"feature": name, "on": not gone, "missing": gone, "install": install if gone else "",
                    "without": without if gone else ""})
    return out
