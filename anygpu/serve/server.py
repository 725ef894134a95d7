"""What the routes share: the engine, the model's limits, metrics, the admission count, and the checks every
request goes through before its response starts (auth, body size and schema, model name, context length,
sampling values), so bad input is a 4xx naming the field, never a broken stream.

``Server.stream`` wraps the engine's async stream for one request: leaving it (finished, failed, or the client
went away and Starlette cancelled the response) aborts the engine request if it still runs, which frees its
KV blocks at the engine's next loop turn; it also returns the admission slot and records the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from ..engine.protocol import EngineProtocol, RequestOutput, SamplingParams
from .errors import APIError, bad_request, from_validation
from .metrics import RequestTimer, ServerMetrics
from .names import ModelNames, default_model_name, parse_names
from .schemas import ChatMessage

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


def engine_error(error: Exception) -> APIError:
    """An error raised by the engine's stream: its ValueErrors name a field (400); anything else is ours (500)."""
    if isinstance(error, ValueError):
        return bad_request(error)
    return APIError(500, f"generation failed: {error}", None, "engine_error")


class Ticket:
    """One admitted request's slot; ``release`` is idempotent."""

    def __init__(self, server: Server):
        self._server = server

    def release(self) -> None:
        if self._server is not None:
            self._server.in_flight -= 1
            self._server = None


class EngineStream(StreamingResponse):
    """A server-sent-event response that always returns its admission slot.

    If the client leaves before Starlette starts iterating the body, the generator never runs, so its own
    cleanup never runs either; closing it and releasing the ticket here covers that case."""

    def __init__(self, content, ticket: Ticket):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._ticket.release()


class Server:
    """State shared by the routes: the engine, the model's limits, metrics and the admission count."""

    def __init__(self, engine: EngineProtocol, model_name: str | list[str] | None, api_key: str | None,
                 max_body_bytes: int, max_concurrent_requests: int, strict_model_name: bool = False):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        names = parse_names(model_name) if model_name is not None else [default_model_name(engine)]
        self.names = ModelNames(names, strict_model_name)
        self.model_name = self.names.primary
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.config.vocab_size
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model_name, engine)

    # -- request checks --------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not depend on how many leading characters match.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", None,
                           "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    async def read_body(self, request: Request, model: type[BaseModel], tgi: bool = False):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise self._too_large()
                chunks.append(chunk)
        except ClientDisconnect:  # the client left, or the edge timed the body out: nobody reads this answer
            raise APIError(400, "body: the connection closed before the whole body arrived", None,
                           "incomplete_body") from None
        try:
            return model.model_validate_json(b"".join(chunks))
        except ValidationError as error:
            raise from_validation(error, tgi) from None

    def _too_large(self) -> APIError:
        return APIError(413, f"body: larger than the limit of {self.max_body_bytes} bytes", None,
                        "request_too_large")

    def check_model(self, name: str | None) -> str:
        """The model name to answer with (``names.ModelNames``: the policy), or 404 when strict and unknown."""
        return self.names.resolve(name)

    def admit(self) -> Ticket:
        """A slot among ``max_concurrent_requests``, or 429 with Retry-After; 503 if the engine has died (before
        a stream's 200 is sent: afterwards the error could only go in-band).  Give the slot back with
        ``ticket.release()`` (Server.stream and EngineStream both do; it counts once)."""
        if not self.engine.healthy:
            raise APIError(503, "the engine stopped after an error; retry once the server has restarted", None,
                           "engine_unavailable")
        if self.in_flight >= self.max_concurrent_requests:
            raise APIError(429, f"the server is busy: {self.in_flight} requests in flight (the limit is "
                                f"{self.max_concurrent_requests}); retry later", None, "server_overloaded",
                           {"Retry-After": "1"})
        self.in_flight += 1
        return Ticket(self)

    def tokenize(self, prompt, param: str, status: int = 400) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(status, f"{param}: this model has no tokenizer; send token ids", param)
            return self.tokenizer.encode(prompt)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(status, f"{param}: token ids must be in [0, {self.vocab_size}), got {bad[:3]}", param)
        return list(prompt)

    def chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise APIError(400, "messages: this model has no chat template; use /v1/completions", "messages")
        try:
            return self.tokenizer.encode_chat([m.as_template_message() for m in messages], add_generation_prompt)
        except Exception as error:  # the template's own raise_exception, or a message it cannot render
            raise APIError(400, f"messages: the chat template failed: {error}", "messages") from None

    def limit_tokens(self, ids: list[int], requested: int | None, default: int | None, prompt_param: str,
                     max_param: str, status: int = 400) -> int:
        """The max_tokens to run with: the request's if it fits the context, else a 4xx naming the field."""
        room = self.max_model_len - len(ids)
        if room < 1:
            raise APIError(status, f"{prompt_param}: {len(ids)} tokens leave no room to generate in this model's "
                                   f"context of {self.max_model_len} tokens", prompt_param, "context_length_exceeded")
        if requested is not None and requested > room:
            raise APIError(status, f"{max_param}: {requested} tokens requested, but the prompt's {len(ids)} tokens "
                                   f"leave room for {room} in this model's context of {self.max_model_len}",
                           max_param, "context_length_exceeded")
        if requested is not None:
            return requested
        return room if default is None else min(default, room)

    def sampling(self, make, status: int = 400) -> SamplingParams:
        try:
            params = make()
            params.validate(self.vocab_size)
        except ValueError as error:
            raise bad_request(error, status=status) from None
        return params

    # -- running ---------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def stream(self, request_id: str, ids: list[int], params: SamplingParams, timer: RequestTimer,
                     ticket: Ticket):
        """The engine's outputs for one request; on exit (finished, failed, or the client left) the request
        is aborted if still running, the admission slot is returned, and the metrics are recorded."""
        gen = self.engine.generate(request_id, ids, params)
        reason = None

        async def outputs() -> AsyncIterator[RequestOutput]:
            nonlocal reason
            async for out in gen:
                timer.tokens_out(time.monotonic(), sum(len(c.delta_token_ids) for c in out.outputs))
                reason = out.outputs[0].finish_reason
                yield out

        try:
            yield outputs()
        finally:
            await gen.aclose()
            ticket.release()
            timer.finished(time.monotonic(), len(ids), reason)

    async def complete(self, request: Request, request_id: str, ids: list[int], params: SamplingParams,
                       timer: RequestTimer, ticket: Ticket) -> RequestOutput | None:
        """Run a non-streaming request to its end: the last output, or None if the client left first (the
        request is then aborted).  Polls for the disconnect, which Starlette only notices for streams."""
        async def last_output():
            last = None
            async with self.stream(request_id, ids, params, timer, ticket) as outputs:
                async for out in outputs:
                    last = out
            return last

        task = asyncio.ensure_future(last_output())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return None
        except Exception as error:
            raise engine_error(error) from None
        finally:
            if not task.done():
                task.cancel()
            ticket.release()

