"""uvicorn's httptools protocol with the limits of ``limits.EdgeLimits``: head sizes (414, 431), head and body
deadlines (408), and a cap on open connections (503).

httptools has no size cap (it buffers a header of any length until its end) and uvicorn no header or body
timeout, so this subclass adds them around the parser and keeps uvicorn's request handling unchanged (and its
C parser: a request that arrives in one read costs two counters and no timer).

A connection is in one of three states, moved by the parser's callbacks: ``IDLE`` (between requests), ``HEAD``
(a request line has begun), ``BODY`` (headers done, body not).  After every read the timers follow the state:
the head deadline runs while a head is awaited from the client (or a fresh connection has sent nothing), the
body deadline while a body is; neither runs while the server is still answering (a pipelined request waits for
it without the client being slow).
"""

from __future__ import annotations

import json

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .errors import APIError
from .limits import EdgeLimits
from .tgi_api import TGI_PATHS

IDLE, HEAD, BODY = 0, 1, 2
LINGER_S = 2.0  # how long a refused connection's remaining input is read and dropped before closing


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; ``data_received`` answers with it."""

    def __init__(self, error: APIError):
        self.error = error


def _overloaded_app(limit: int):
    """The ASGI app a connection above ``max_connections`` is answered by (after its headers), then closed."""
    error = APIError(503, f"the server has {limit} connections open, its limit; retry later", None,
                     "too_many_connections", tgi_type="overloaded")

    async def app(scope, receive, send):
        body = json.dumps(error.tgi_body() if scope["path"] in TGI_PATHS else error.openai_body()).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return app


class EdgeProtocol(HttpToolsProtocol):
    limits = EdgeLimits()

    @classmethod
    def with_limits(cls, limits: EdgeLimits) -> type[EdgeProtocol]:
        """A subclass bound to ``limits`` (uvicorn builds protocols from a class and its own config)."""
        return type(cls.__name__, (cls,), {"limits": limits, "_overloaded": staticmethod(
            _overloaded_app(limits.max_connections))})

    _overloaded = staticmethod(_overloaded_app(EdgeLimits().max_connections))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_timeout
        self._state = IDLE
        self._head_bytes = 0  # bytes read while a head was incomplete (reset when one completes)
        self._header_count = 0
        self._head_timer = None
        self._body_timer = None
        self._closed = False

    # -- reads ---------------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._follow_state()

    def connection_lost(self, exc) -> None:
        self._closed = True
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if self._state != BODY:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            if isinstance(error.__context__, _Refused):  # a limit, raised from a callback below
                self._refuse(error.__context__.error)
                return
            self.logger.warning("Invalid HTTP request received.")
            self._cancel_timers()
            self.send_400_response("Invalid HTTP request received.")
            self._closed = True
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        if self._state == HEAD and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(self._head_too_large())
            return
        self._follow_state()

    # -- parser callbacks ------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._state = HEAD
        self._header_count = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_request_line:
            raise _Refused(APIError(414, f"request line: longer than the limit of {self.limits.max_request_line} "
                                         f"bytes", None, "uri_too_long"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            raise _Refused(APIError(431, f"headers: more than the limit of {self.limits.max_headers} header lines",
                                    None, "too_many_headers"))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        # The exact size, for a head that arrived whole in one read (the per-read count sees only incomplete ones).
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            raise _Refused(self._head_too_large())
        self._state, self._head_bytes = BODY, 0
        if len(self.connections) > self.limits.max_connections:
            app, self.app = self.app, self._overloaded
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._state = IDLE
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._closed and not self.transport.is_closing():
            self._follow_state()  # a pipelined request may now be the one awaited from the client

    # -- deadlines -------------------------------------------------------------------------------------------
    def _follow_state(self) -> None:
        answering = self.cycle is not None and not self.cycle.response_complete
        want_head = not answering and (self._state == HEAD or (self._state == IDLE and self.cycle is None))
        want_body = self._state == BODY and not self.pipeline
        if want_head and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)
        elif not want_head and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if want_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timed_out)
        elif not want_body and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._state == HEAD:
            self._refuse(APIError(408, f"headers: not complete within {self.limits.header_timeout:g} s", None,
                                  "request_timeout"))
        else:  # a connection that never sent a byte gets no answer (as nginx and Apache do)
            self._close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            # The route is waiting for the body: it now reads a disconnect, and whatever it answers is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            self._refuse(APIError(408, f"body: not complete within {self.limits.body_timeout:g} s", None,
                                  "request_timeout"))
        else:
            self._close()

    # -- answers ---------------------------------------------------------------------------------------------
    def _head_too_large(self) -> APIError:
        return APIError(431, f"headers: the request line and headers are larger than the limit of "
                             f"{self.limits.max_header_bytes} bytes", None, "request_header_fields_too_large")

    def _refuse(self, error: APIError) -> None:
        """Answer ``error`` and close, unless a response is already under way (then only close)."""
        if self._closed:
            return
        if self.cycle is None or self.cycle.response_complete or self.cycle.disconnected:
            path = self.url.split(b"?", 1)[0].decode("latin-1") if getattr(self, "url", None) else ""
            body = json.dumps(error.tgi_body() if path in TGI_PATHS else error.openai_body()).encode()
            head = [STATUS_LINE[error.status]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                     b"\r\nconnection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
            if self.transport.can_write_eof():
                # A lingering close, as nginx's: send the answer and FIN, then read and drop what the client is
                # still sending for a moment.  Closing with unread data would send a reset, which can make the
                # client's kernel drop our answer before the client reads it.
                self.transport.write_eof()
                self._closed = True
                self._cancel_timers()
                self.flow.resume_reading()
                self._head_timer = self.loop.call_later(LINGER_S, self._close)
                return
        self._close()

    def _close(self) -> None:
        self._closed = True
        self._cancel_timers()
        if not self.transport.is_closing():
            self.transport.close()
