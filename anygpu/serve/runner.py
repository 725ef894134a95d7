"""Running the app with uvicorn: ``serve`` in the foreground (the CLI), ``ServerThread`` in the background (tests
and ``anygpu bench serve``: a real socket on loopback, the caller's process keeps the engine in reach).

The socket is bound here, not by uvicorn, so port 0 works (the OS picks a free port; ``.url`` says which) and
a port already in use fails before the model is loaded twice.  Connections go through ``edge.EdgeProtocol``
(uvicorn's httptools protocol with the size limits, deadlines and connection cap of ``limits.EdgeLimits``).

``serve(..., alive=engine_is_healthy)`` also stops the server when the engine has died, and says so: a server
that answers 503 forever is worse than one that exits and is restarted by its supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from .edge import EdgeProtocol
from .limits import EdgeLimits

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


def _config(app, log_level: str, limits: EdgeLimits | None, access_log: bool) -> uvicorn.Config:
    # http: httptools (a C parser: several times less Python per request than h11) with our limits around it;
    # loop "auto": uvloop when installed.
    # timeout_graceful_shutdown: open streams get a few seconds to finish, then are cut (their requests abort).
    limits = limits or EdgeLimits()
    return uvicorn.Config(app, http=EdgeProtocol.with_limits(limits), log_level=log_level,
                          timeout_graceful_shutdown=5, timeout_keep_alive=limits.keep_alive_timeout,
                          access_log=access_log, lifespan="off", backlog=2048)


class _ForegroundServer(uvicorn.Server):
    """uvicorn's server, but SIGINT and SIGTERM only stop it: uvicorn re-raises the signal once it has shut
    down, which would kill the process before the caller can stop the engine (and its tensor-parallel
    workers).  A second signal still forces the exit, as in uvicorn.

    With ``alive``, it also stops once ``alive()`` is false (checked every half second); ``died`` then says why."""

    def __init__(self, config: uvicorn.Config, alive=None):
        super().__init__(config)
        self._alive = alive
        self.died: str | None = None

    async def on_tick(self, counter: int) -> bool:
        if self._alive is not None and self.died is None and counter % 5 == 0 and not self._alive():
            self.died = "the engine has died"
            log.error("%s; stopping the server so that its supervisor can restart it", self.died)
            self.should_exit = True
        return await super().on_tick(counter)

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


def serve(app, sock: socket.socket, log_level: str = "info", limits: EdgeLimits | None = None,
          access_log: bool = False, alive=None) -> str | None:
    """Serve until SIGINT (Ctrl-C) or SIGTERM, or until ``alive()`` turns false; returns once open streams are
    done or cut: None after a signal, else why the server stopped itself (the caller should exit non-zero)."""
    server = _ForegroundServer(_config(app, log_level, limits, access_log), alive)
    server.run(sockets=[sock])
    return server.died


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.url + "/health")``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: EdgeLimits | None = None):
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{self.port}" if ":" not in host else f"http://[{host}]:{self.port}"
        self.server = uvicorn.Server(_config(app, log_level, limits, access_log=False))
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
