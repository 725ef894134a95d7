"""The engine protocol (``anygpu/engine/protocol.py``): ``serve/`` imports no engine module but that one, the three
engine classes have every member of their protocol (real objects, a tiny random model on the CPU), the server
runs over an engine that offers nothing else, and ``/metrics`` reports what ``stats()`` says."""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
from typing import Protocol

import httpx
import pytest

from anygpu.bench.model import random_engine
from anygpu.engine import AsyncLLMEngine, SamplingParams
from anygpu.engine.engine_process import EngineClient
from anygpu.engine.protocol import EngineInfo, EngineProtocol, EngineStats, StepEngine
from anygpu.serve import ServerThread, build_app

SERVE = pathlib.Path(__file__).resolve().parents[1] / "anygpu" / "serve"
ALLOWED = "engine.protocol"


def _engine_imports(path: pathlib.Path):
    """(line, module) for each import of an ``anygpu.engine`` module, written as a path below ``anygpu``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 2 or (node.level == 0 and (node.module or "").startswith("anygpu")):
                module = node.module or ""
                module = module.removeprefix("anygpu").lstrip(".") if node.level == 0 else module
                if module == "":  # from .. import engine / from anygpu import engine
                    for alias in node.names:
                        if alias.name == "engine":
                            yield node.lineno, "engine"
                elif module.split(".")[0] == "engine":
                    yield node.lineno, module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[:2] == ["anygpu", "engine"]:
                    yield node.lineno, alias.name.removeprefix("anygpu.")


def test_serve_imports_only_the_engine_protocol():
    bad = [f"anygpu/serve/{path.name}:{line} imports {module}"
           for path in sorted(SERVE.glob("*.py")) for line, module in _engine_imports(path) if module != ALLOWED]
    assert not bad, "serve/ may import only anygpu.engine.protocol:\n" + "\n".join(bad)


def test_the_import_check_catches_what_it_should(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("from ..engine import LLMEngine\nfrom ..engine.guided import g\nfrom .. import engine\n"
                    "import anygpu.engine.scheduler\nfrom anygpu.engine.sampler import S\n"
                    "from ..engine.protocol import SamplingParams\nfrom .protocol import X\n")
    assert [m for _, m in _engine_imports(path)] == ["engine", "engine.guided", "engine", "engine.scheduler",
                                                     "engine.sampler", "engine.protocol"]


# -- the classes against their protocols ---------------------------------------------------------------------
def members(proto) -> set[str]:
    """Every member a protocol asks for, its bases' included."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if getattr(cls, "_is_protocol", False) and cls is not Protocol:
            names |= set(getattr(cls, "__annotations__", {}))
            names |= {n for n in vars(cls) if not n.startswith("_")}
    return names


def check(obj, proto) -> None:
    assert isinstance(obj, proto)
    missing = sorted(n for n in members(proto) if not hasattr(obj, n))
    assert not missing, f"{type(obj).__name__} lacks {missing} of {proto.__name__}"
    for name in members(proto):
        want = vars(next(c for c in proto.__mro__ if name in vars(c) or name in getattr(c, "__annotations__", {})))
        if inspect.isfunction(want.get(name)):  # a method: the same parameters, in order
            expected = list(inspect.signature(want[name]).parameters)[1:]
            assert list(inspect.signature(getattr(obj, name)).parameters) == expected, (type(obj).__name__, name)
    stats = obj.stats()
    assert isinstance(stats, EngineStats) and stats.num_blocks > 0
    assert isinstance(obj.eos_token_ids, frozenset) and isinstance(obj.healthy, bool)
    assert obj.config.vocab_size > 0 and obj.max_model_len > 0 and obj.model_name


@pytest.fixture(scope="module")
def llm():
    return random_engine("tiny", max_num_seqs=4, progress=False)


def test_llm_engine_is_a_step_engine(llm):
    check(llm, StepEngine)
    assert llm.healthy and llm.stats() == EngineStats(0, 0, llm.block_manager.num_blocks, llm.block_manager.num_blocks)
    llm.add_request("a", [100, 200, 300], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.add_request("b", [100, 200, 301], SamplingParams(max_tokens=50, ignore_eos=True))
    assert (llm.stats().num_running, llm.stats().num_waiting) == (0, 2)
    llm.step()
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 0) and 0 < stats.kv_cache_usage < 1
    assert stats.num_free_blocks == llm.block_manager.num_free_blocks
    llm.abort("a")
    llm.abort("b")
    assert llm.stats().kv_cache_usage == 0.0


def test_llm_engine_turns_unhealthy_when_a_step_raises():
    llm = random_engine("tiny", max_num_seqs=2, progress=False)

    def broken(batch):
        raise RuntimeError("device lost")

    llm.runner.run = broken
    llm.add_request("a", [100, 200], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="device lost"):
        llm.step()
    assert not llm.healthy and "device lost" in str(llm.error)


def test_async_engine_is_the_servers_protocol(llm):
    engine = AsyncLLMEngine(llm)
    try:
        check(engine, EngineProtocol)
        for name in members(EngineInfo) - {"stats", "healthy", "abort"}:
            assert getattr(engine, name) is getattr(llm, name), name
        assert engine.stats() == llm.stats()
    finally:
        engine.shutdown()


def test_engine_client_is_a_step_engine():
    client = EngineClient(functools.partial(random_engine, "tiny", max_num_seqs=4, progress=False))
    try:
        check(client, StepEngine)
        assert client.healthy and client.stats().kv_cache_usage == 0.0 and client.stats().num_running == 0
        client.add_request("a", [100, 200, 300], SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(2000):  # step() waits poll_s for the engine process's first output
            if client.step():
                break
        # The numbers came with that step from the engine process.
        assert client.stats().num_running == 1 and client.stats().kv_cache_usage > 0
        client.abort("a")
    finally:
        client.close()
    assert not client.healthy


# -- the server over the protocol and nothing more -----------------------------------------------------------
class OnlyProtocol:
    """An engine that offers the server ``EngineProtocol``'s members and nothing else: a route that reaches past
    the protocol gets an AttributeError (a 500)."""

    def __init__(self, engine, stats: EngineStats | None = None):
        self._engine, self._stats = engine, stats

    def __getattr__(self, name):
        if name not in members(EngineProtocol):
            raise AttributeError(f"the server read {name!r}, which engine/protocol.py does not offer")
        if name == "stats" and self._stats is not None:
            return lambda: self._stats
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def async_engine(llm):
    engine = AsyncLLMEngine(llm)
    yield engine
    engine.shutdown()


def test_every_route_runs_on_the_protocol_alone(async_engine):
    engine = OnlyProtocol(async_engine)
    assert isinstance(engine, EngineProtocol)
    body = {"model": "tiny", "prompt": [100, 200, 300], "max_tokens": 4, "ignore_eos": True}
    with ServerThread(build_app(engine)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path, json in [
                ("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/info", None),
                ("GET", "/version", None), ("GET", "/metrics", None),
                ("POST", "/v1/completions", body), ("POST", "/v1/completions", {**body, "stream": True}),
                ("POST", "/generate", {"inputs": "w100 w200", "parameters": {"max_new_tokens": 3}}),
                ("POST", "/generate_stream", {"inputs": "w100 w200", "parameters": {"max_new_tokens": 3}}),
                ("POST", "/tokenize", {"prompt": "w100 w200"}), ("POST", "/detokenize", {"tokens": [100, 200]})]:
            r = http.request(method, path, json=json)
            assert r.status_code == 200, (path, r.text)
        info = http.get("/info").json()
        assert info["model_device_type"] == "cpu" and info["max_total_tokens"] == async_engine.max_model_len


def test_metrics_report_the_engines_stats(async_engine):
    stats = EngineStats(num_running=3, num_waiting=2, num_blocks=10, num_free_blocks=4)
    with ServerThread(build_app(OnlyProtocol(async_engine, stats))) as server:
        text = httpx.get(server.url + "/metrics").text
    assert 'anygpu_num_requests_running{model_name="tiny"} 3.0' in text
    assert 'anygpu_num_requests_waiting{model_name="tiny"} 2.0' in text
    assert 'anygpu_kv_cache_usage_perc{model_name="tiny"} 0.6' in text
