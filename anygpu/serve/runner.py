"""Running the app with uvicorn: ``serve`` in the foreground (the CLI), ``ServerThread`` in the background (tests
and ``anygpu bench serve``: a real socket on loopback, the caller's process keeps the engine in reach).

The socket is bound here, not by uvicorn, so port 0 works (the OS picks a free port; ``.url`` says which) and
a port already in use fails before the model is loaded twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

log = logging.getLogger("anygpu.serve")

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"port: cannot listen on {host}:{port} ({error.strerror})") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _config(app, log_level: str) -> uvicorn.Config:
    # http/loop "auto": httptools and uvloop when installed (C parsers and loop: several times less Python per
    # streamed chunk than h11 and asyncio's loop), else the pure-Python ones.
    # timeout_graceful_shutdown: open streams get a few seconds to finish, then are cut (their requests abort).
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False,
                          lifespan="off", backlog=2048)


class _ForegroundServer(uvicorn.Server):
    """uvicorn's server, but SIGINT and SIGTERM only stop it: uvicorn re-raises the signal once it has shut
    down, which would kill the process before the caller can stop the engine (and its tensor-parallel
    workers).  A second signal still forces the exit, as in uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app, sock: socket.socket, log_level: str = "info") -> None:
    """Serve until SIGINT (Ctrl-C) or SIGTERM; returns once open streams are done or cut."""
    _ForegroundServer(_config(app, log_level)).run(sockets=[sock])


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.url + "/health")``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{self.port}" if ":" not in host else f"http://[{host}]:{self.port}"
        self.server = uvicorn.Server(_config(app, log_level))
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="anygpu-http", daemon=True)

    def _run(self) -> None:
        # uvicorn's choice of loop (uvloop when installed), as the foreground server gets.
        factory = self.server.config.get_loop_factory() if hasattr(self.server.config, "get_loop_factory") else None
        self.loop = factory() if factory is not None else asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    def start(self) -> ServerThread:
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server thread ended before it started")
            self._thread.join(timeout=0.01)
        return self

    def call(self, coro_fn, timeout: float = 10.0):
        """Run ``coro_fn()`` on the server's event loop (tests inspect its tasks)."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
