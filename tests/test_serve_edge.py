"""The HTTP edge with raw sockets on loopback (issue 21, items 2, 3, 7 and 9): head sizes (414, 431), head and
body deadlines against slow clients (408), keep-alive, the connection cap (503), 4xx error types, and a dead
engine answering 503 before any stream starts.  Timeouts are set short here so that each case takes seconds."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from anygpu.bench.model import random_engine
from anygpu.engine import AsyncLLMEngine
from anygpu.serve import EdgeLimits, ServerThread, build_app

LIMITS = EdgeLimits(max_request_line=1024, max_header_bytes=4096, max_headers=20, header_timeout=1.0,
                    body_timeout=1.0, keep_alive_timeout=1.0, max_connections=8)


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine(random_engine("tiny", max_num_seqs=4, progress=False))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine), limits=LIMITS) as s:
        yield s


def connect(server, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=timeout)
    return sock


def read_response(sock) -> tuple[int, dict, bytes]:
    """One response (status, headers, body), read until the server closes or Content-Length is met."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before a response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", -1))
    while length >= 0 and len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def closed_by_server(sock, within: float) -> bool:
    """True if the server closes ``sock`` (EOF or reset) within ``within`` seconds; reads and drops any data."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n"


# -- sizes ----------------------------------------------------------------------------------------------------
def test_normal_request_over_the_edge(server):
    with connect(server) as s:
        s.sendall(get("/health"))
        status, headers, body = read_response(s)
        assert status == 200 and json.loads(body) == {"status": "ok"}
        s.sendall(get("/health"))  # the same connection again: keep-alive works
        assert read_response(s)[0] == 200


def test_long_request_line_is_414(server):
    with connect(server) as s:
        s.sendall(get("/v1/models?q=" + "a" * 2000))
        status, _, body = read_response(s)
        err = json.loads(body)["error"]
        assert status == 414 and err["type"] == "invalid_request_error" and "1024" in err["message"]
        assert closed_by_server(s, 5)


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "dribbled"])
def test_huge_header_is_431(server, split):
    """The probe's case, scaled to the test's limit: one header far over it, whole or in pieces."""
    request = get("/health", b"X-Big: " + b"b" * 200_000 + b"\r\n")
    with connect(server) as s:
        if split:
            for i in range(0, len(request), 3000):
                try:
                    s.sendall(request[i:i + 3000])
                except (BrokenPipeError, ConnectionResetError):
                    break
        else:
            try:
                s.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass
        status, _, body = read_response(s)
        assert status == 431 and json.loads(body)["error"]["code"] == "request_header_fields_too_large"


def test_the_probes_64_mb_header_and_5000_headers_get_431_at_the_defaults(engine):
    """Issue 21 item 2, the exact cases: one 64 MB header got 200, 5000 headers were accepted."""
    with ServerThread(build_app(engine)) as server:
        for request in (get("/health", b"X-Big: " + b"b" * (64 << 20) + b"\r\n"),
                        get("/health", b"".join(b"X-H%d: v\r\n" % i for i in range(5000)))):
            with connect(server) as s:
                try:
                    s.sendall(request)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server stopped reading at its limit
                status, _, body = read_response(s)
                assert status == 431 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_many_headers_are_431(server):
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(5000))
    with connect(server) as s:
        try:
            s.sendall(get("/health", headers))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, body = read_response(s)
        err = json.loads(body)["error"]
        assert status == 431 and err["code"] == "too_many_headers" and "20" in err["message"]


def test_tgi_route_gets_tgi_error_shape_at_the_edge(server):
    with connect(server) as s:
        try:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(50)))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, body = read_response(s)
        assert status == 431 and json.loads(body)["error_type"] == "validation"


def test_headers_just_under_the_limits_pass(server):
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(19))  # 19 + Host = 20, ~2.2 KB
    with connect(server) as s:
        s.sendall(get("/health", headers))
        assert read_response(s)[0] == 200


# -- deadlines ------------------------------------------------------------------------------------------------
def test_slowloris_head_is_cut_with_408(server):
    """A head sent a byte at a time never completes: it is cut at the head deadline, not kept open."""
    socks = [connect(server) for _ in range(4)]
    try:
        start = time.monotonic()
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHo")
        for _ in range(3):  # keep trickling, as slowloris does
            time.sleep(0.3)
            for s in socks:
                try:
                    s.sendall(b"s")
                except OSError:
                    pass
        for s in socks:
            s.settimeout(5)
            status, _, body = read_response(s)
            assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
            assert closed_by_server(s, 5)
        assert time.monotonic() - start < 5  # LIMITS.header_timeout is 1 s; without one they stay open
    finally:
        for s in socks:
            s.close()


def test_silent_connection_is_closed(server):
    with connect(server) as s:
        assert closed_by_server(s, 5)


def test_slow_body_is_cut_with_408(server):
    body = json.dumps({"model": "tiny", "prompt": [100, 101], "max_tokens": 2}).encode()
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        s.settimeout(5)
        status, _, answer = read_response(s)
        assert status == 408 and "body" in json.loads(answer)["error"]["message"]
        assert closed_by_server(s, 5)


def test_body_in_pieces_within_the_deadline_is_served(server):
    body = json.dumps({"model": "tiny", "prompt": [100, 101], "max_tokens": 2}).encode()
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.2)
        s.sendall(body[:10])
        time.sleep(0.2)
        s.sendall(body[10:])
        status, _, answer = read_response(s)
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2


def test_idle_keep_alive_connection_is_closed(server):
    with connect(server) as s:
        s.sendall(get("/health"))
        assert read_response(s)[0] == 200
        assert closed_by_server(s, 5)  # LIMITS.keep_alive_timeout is 1 s


def test_connections_over_the_cap_get_503_and_the_rest_are_served(server):
    held = [connect(server) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.2)  # let the server accept them all
        with connect(server) as extra:
            extra.sendall(get("/v1/models"))
            status, headers, body = read_response(extra)
            assert status == 503 and headers["retry-after"] == "1"
            assert json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(server.url + "/health").status_code == 200


# -- error types (item 9) -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,status", [("GET", "/v1/completions", 405), ("DELETE", "/generate", 405),
                                                ("GET", "/nope", 404)])
def test_generic_4xx_are_the_clients_errors(server, method, path, status):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status
    if path in ("/generate", "/generate_stream", "/info"):
        assert r.json()["error_type"] == "validation"
    else:
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_body_over_the_limit_is_413_invalid_request(server):
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (5 << 20))
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


# -- a dead engine (item 7) -----------------------------------------------------------------------------------
def test_dead_engine_answers_503_before_any_stream():
    eng = AsyncLLMEngine(random_engine("tiny", max_num_seqs=4, progress=False))

    def broken(batch):
        raise RuntimeError("device lost")

    eng.engine.runner.run = broken
    try:
        with ServerThread(build_app(eng)) as server, httpx.Client(timeout=30) as client:
            body = {"model": "tiny", "prompt": [100, 101], "max_tokens": 4}
            assert client.post(server.url + "/v1/completions", json=body).status_code == 500  # the step that died
            for url, payload in (("/v1/completions", {**body, "stream": True}), ("/v1/completions", body),
                                 ("/generate_stream", {"inputs": "w1 w2", "parameters": {"max_new_tokens": 2}})):
                r = client.post(server.url + url, json=payload)
                assert r.status_code == 503, (url, r.text)
                assert r.headers["content-type"] == "application/json"
                if url.startswith("/generate"):
                    assert r.json()["error_type"] == "unhealthy"
                else:
                    assert r.json()["error"]["code"] == "engine_unavailable"
    finally:
        eng.shutdown()


# -- API keys (item 8) ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["", "  ", "clé", "a b", "k\x01"])
def test_build_app_refuses_keys_no_client_can_send(engine, key):
    with pytest.raises(ValueError, match="api_key: expected"):
        build_app(engine, api_key=key)
