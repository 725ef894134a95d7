"""The server under load and under faults, on a tiny random model (CPU) with real HTTP clients on loopback:
500 requests at concurrency 32 with a fifth leaving mid-stream end with no 5xx, every KV block free, no engine
request and no asyncio task left behind; a client that leaves frees its blocks at once (streaming or not); a
full server answers 429 with Retry-After and recovers."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from anygpu.bench import serve as load
from anygpu.bench.model import random_engine, random_prompts
from anygpu.engine import AsyncLLMEngine
from anygpu.serve import ServerThread, build_app


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine(random_engine("tiny", max_num_seqs=32, progress=False))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def slow_engine():
    """Steps of at least 10 ms, so a 2000-token request runs for 20 s or more: leaving early must be what
    frees it (the tiny model alone would finish 2000 tokens in about a second)."""
    llm = random_engine("tiny", max_num_seqs=4, progress=False)
    run = llm.runner.run

    def slow_run(batch):
        time.sleep(0.01)
        return run(batch)

    llm.runner.run = slow_run
    eng = AsyncLLMEngine(llm)
    yield eng
    eng.shutdown()


def wait_idle(engine, timeout: float = 2.0) -> float:
    """Seconds until the engine holds no request and no KV block (fails after ``timeout``)."""
    start = time.monotonic()
    llm = engine.engine
    while time.monotonic() - start < timeout:
        stats = engine.stats()
        if not llm.requests and stats.num_free_blocks == stats.num_blocks and engine.num_requests == 0:
            return time.monotonic() - start
        time.sleep(0.005)
    pytest.fail(f"engine not idle after {timeout}s: {len(llm.requests)} requests, "
                f"{stats.num_free_blocks}/{stats.num_blocks} blocks free")


def tasks_on(server) -> int:
    async def count():
        return len(asyncio.all_tasks())
    return server.call(count)


@pytest.fixture(scope="module")
def process_engine():
    """The engine in its own process, as `anygpu serve` runs it."""
    import functools

    from anygpu.engine.engine_process import EngineClient

    client = EngineClient(functools.partial(random_engine, "tiny", max_num_seqs=32, progress=False))
    eng = AsyncLLMEngine(client)
    yield eng
    eng.shutdown()
    client.close()


@pytest.mark.parametrize("where", ["thread", "process"])
def test_500_requests_with_disconnects(where, request):
    engine = request.getfixturevalue("engine" if where == "thread" else "process_engine")
    app = build_app(engine)
    with ServerThread(app) as server:
        before = tasks_on(server)
        prompts = random_prompts(500, 16, 1024, seed=3)
        records, start, end = asyncio.run(load.run_load(server.url, "tiny", prompts, output_len=8, concurrency=32,
                                                        disconnect_fraction=0.2, seed=5))
        summary = load.summarize(records, end - start)
        assert summary["status_5xx"] == 0 and summary["failed"] == 0, summary["errors"]
        assert summary["disconnected"] > 60 and summary["completed"] + summary["disconnected"] == 500
        assert all(r["output_tokens"] == 8 for r in records if r["ok"])
        wait_idle(engine)
        assert app.state.server.in_flight == 0
        deadline = time.monotonic() + 2
        while tasks_on(server) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tasks_on(server) <= before
        # The metrics saw every request once: finished by "length", or aborted.  A client that left after the
        # last token had been sent (several tokens can share a chunk under load) counts as finished there.
        text = httpx.get(server.url + "/metrics").text
        by_reason = {line.split('finished_reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                     for line in text.splitlines() if line.startswith("anygpu_request_success_total")}
        assert sum(by_reason.values()) == 500
        assert summary["completed"] <= by_reason["length"] <= summary["completed"] + summary["disconnected"]


def test_stream_disconnect_frees_blocks_at_once(slow_engine):
    engine = slow_engine
    with ServerThread(build_app(engine)) as server:
        body = {"model": "tiny", "prompt": list(range(100, 120)), "max_tokens": 2000, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(4)]
                assert any(line.startswith("data: ") for line in got)
                assert engine.engine.block_manager.num_free_blocks < engine.engine.block_manager.num_blocks
            # 2000 tokens would take seconds; leaving must free everything in well under one.
        assert wait_idle(engine, timeout=1.0) < 1.0
        assert engine.engine.scheduler.num_running == 0


def test_plain_request_disconnect_aborts(slow_engine):
    engine = slow_engine
    with ServerThread(build_app(engine)) as server:
        body = {"model": "tiny", "prompt": list(range(100, 120)), "max_tokens": 2000, "ignore_eos": True}

        async def leave_early():
            async with httpx.AsyncClient(timeout=30) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(server.url + "/v1/completions", json=body, timeout=0.3)

        asyncio.run(leave_early())
        assert engine.engine.requests  # still running right after the client left...
        wait_idle(engine, timeout=2.0)  # ...and aborted by the server's disconnect watch soon after


def test_full_server_says_429_then_recovers(slow_engine):
    engine = slow_engine
    app = build_app(engine, max_concurrent_requests=2)
    with ServerThread(app) as server, httpx.Client(timeout=30) as client:
        body = {"model": "tiny", "prompt": [100, 101, 102], "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with client.stream("POST", server.url + "/v1/completions", json=body) as a, \
                client.stream("POST", server.url + "/v1/completions", json=body) as b:
            lines_a, lines_b = a.iter_lines(), b.iter_lines()  # kept: a dropped iterator closes its connection
            next(lines_a), next(lines_b)
            r = client.post(server.url + "/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
            tgi = client.post(server.url + "/generate", json={"inputs": "w5 w6"})
            assert tgi.status_code == 429 and tgi.json()["error_type"] == "overloaded"
        wait_idle(engine)
        assert app.state.server.in_flight == 0
        ok = client.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_engine_failure_is_reported_not_hung():
    """A step that raises (here: a broken runner) fails its request with 500, and later requests, streamed or not,
    and /health with 503 (a stream is refused before its 200); the HTTP server itself keeps answering."""
    eng = AsyncLLMEngine(random_engine("tiny", max_num_seqs=4, progress=False))

    def broken(batch):
        raise RuntimeError("device lost")

    eng.engine.runner.run = broken
    try:
        with ServerThread(build_app(eng)) as server, httpx.Client(timeout=30) as client:
            body = {"model": "tiny", "prompt": [100, 101], "max_tokens": 4}
            r = client.post(server.url + "/v1/completions", json=body)
            assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
            assert client.get(server.url + "/health").status_code == 503
            r = client.post(server.url + "/v1/completions", json={**body, "stream": True})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        eng.shutdown()


# -- the engine in its own process (what `anygpu serve` runs) -----------------------------------------------------
def test_engine_process_serves_the_same_tokens_and_frees_on_disconnect(engine):
    import functools

    from anygpu.engine.engine_process import EngineClient

    client = EngineClient(functools.partial(random_engine, "tiny", max_num_seqs=8, progress=False))
    remote = AsyncLLMEngine(client)
    try:
        body = {"model": "tiny", "prompt": [100, 200, 300], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        with ServerThread(build_app(engine)) as here, ServerThread(build_app(remote)) as there:
            a = httpx.post(here.url + "/v1/completions", json=body, timeout=60).json()
            b = httpx.post(there.url + "/v1/completions", json=body, timeout=60).json()
            assert a["choices"][0]["text"] == b["choices"][0]["text"] and b["usage"]["completion_tokens"] == 10
            # A stream that leaves: the engine process frees the blocks and reports it.
            long = {**body, "max_tokens": 1900, "stream": True}
            with httpx.stream("POST", there.url + "/v1/completions", json=long, timeout=60) as r:
                lines = r.iter_lines()
                next(lines)
            deadline = time.monotonic() + 2
            while (client.requests or client.stats().kv_cache_usage > 0) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not client.requests
            assert client.stats().num_free_blocks == client.stats().num_blocks
            assert client.stats().num_running == 0
            metrics = httpx.get(there.url + "/metrics").text
            assert 'anygpu_kv_cache_usage_perc{model_name="tiny"} 0.0' in metrics
    finally:
        remote.shutdown()
        client.close()
    assert not client._proc.is_alive()


def test_engine_process_errors():
    import functools

    from anygpu.engine.engine_process import EngineClient

    with pytest.raises(ValueError, match="random_config"):
        EngineClient(functools.partial(random_engine, "nope"))
    client = EngineClient(functools.partial(random_engine, "tiny", max_num_seqs=2, progress=False))
    try:
        with pytest.raises(ValueError, match="prompt"):
            client.add_request("a", [10**9])
        client.add_request("a", [100, 101])
        with pytest.raises(ValueError, match="request_id"):
            client.add_request("a", [100, 101])
        client._proc.kill()  # the engine process dies: the next step says so instead of waiting forever
        client._proc.join()
        with pytest.raises(RuntimeError, match="engine process died"):
            for _ in range(100):
                client.step()
    finally:
        client.close()
