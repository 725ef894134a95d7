"""The server tests' shared fixtures: the default model's engine (module-scoped; a test module sets
``MAX_MODEL_LEN`` for a longer context), a real server on loopback, and the ``openai`` client for it."""

import pytest

from anygpu.engine import AsyncLLMEngine, LLMEngine
from anygpu.serve import ServerThread, build_app

from ._models_fixtures import smollm_path  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def engine(request, smollm_path):  # noqa: F811
    max_model_len = getattr(request.module, "MAX_MODEL_LEN", 256)
    eng = AsyncLLMEngine(LLMEngine(str(smollm_path), progress=False, max_model_len=max_model_len))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
