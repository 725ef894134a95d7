"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, streaming (server-sent events ending in
``data: [DONE]``) and not.

Defaults, as vLLM's: completions generate at most 16 tokens unless ``max_tokens`` says otherwise (OpenAI's
default); chat generates until EOS or the end of the context.  A stream sends the assistant role first,
then one chunk per new piece of text, then a chunk with ``finish_reason``, then (with
``stream_options.include_usage``) a chunk with ``choices: []`` and the usage; every earlier chunk then carries
``usage: null``.  With log-probabilities asked for, a chunk goes out for every step that brought tokens (its
text may be empty while a stop string is held back) and carries those tokens' log-probabilities
(``logprobs.py``).  An error after the stream has started is sent as ``data: {"error": {...}}``, which
OpenAI's client raises as an APIError.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .logprobs import chat_logprobs, completion_logprobs
from .metrics import RequestTimer
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import EngineStream, Server, dumps, engine_error, sse

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def add_openai_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        server.authorize(request)
        body = await server.read_body(request, CompletionRequest)
        name = server.check_model(body.model)
        body.check_supported()
        ids = server.tokenize(body.single_prompt(), "prompt")
        max_tokens = server.limit_tokens(ids, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt", "max_tokens")
        params = server.sampling(lambda: body.sampling_params(max_tokens))
        return await _respond(request, server, body, name, "cmpl", "text_completion", ids, params, arrival,
                              chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        server.authorize(request)
        body = await server.read_body(request, ChatCompletionRequest)
        name = server.check_model(body.model)
        body.check_supported()
        ids = server.chat_ids(body.messages)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = server.limit_tokens(ids, body.requested_max_tokens, None, "messages", param)
        params = server.sampling(lambda: body.sampling_params(max_tokens))
        return await _respond(request, server, body, name, "chatcmpl", "chat.completion", ids, params, arrival,
                              chat=True)


async def _respond(request, server: Server, body, name: str, prefix: str, obj: str, ids, params, arrival: float,
                   chat: bool):
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    ticket = server.admit()
    timer = RequestTimer(server.metrics, arrival)
    head = {"id": request_id, "object": obj, "created": int(time.time()), "model": name}
    if body.stream:
        return EngineStream(_stream(server, request_id, ids, params, timer, ticket, head, chat, body.include_usage),
                            ticket)

    out = await server.complete(request, request_id, ids, params, timer, ticket)
    if out is None:  # the client left; nobody reads this
        return JSONResponse({}, status_code=499)
    done = out.outputs[0]
    text, tokens, reason = done.text, len(done.token_ids), done.finish_reason
    logprobs = _logprobs(done.token_ids, done.logprobs, params.logprobs, chat)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
               "finish_reason": reason} if chat else
              {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason})
    return {**head, "object": obj, "choices": [choice], "usage": _usage(len(ids), tokens)}


def _logprobs(token_ids, entries, k: int | None, chat: bool, offset: int = 0) -> dict | None:
    if k is None or entries is None:
        return None
    return chat_logprobs(token_ids, entries, k) if chat else completion_logprobs(token_ids, entries, k, offset)


async def _stream(server: Server, request_id, ids, params, timer, ticket, head, chat: bool, include_usage: bool):
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {**head, "object": obj}
    if include_usage:
        base["usage"] = None

    def chunk(text: str | None, finish_reason=None, role: bool = False, logprobs=None):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**base, "choices": [choice]})

    # The chunk sent for every new piece of text, as a template: at a few thousand chunks per second on one
    # event loop, building and serializing the whole dict each time is a measurable share of the server.
    before, after = chunk("\x00").split(dumps("\x00"))

    def text_chunk(text: str) -> str:
        return before + dumps(text) + after

    tokens = 0
    try:
        async with server.stream(request_id, ids, params, timer, ticket) as outputs:
            if chat:
                yield chunk(None, role=True)
            async for out in outputs:
                completion = out.outputs[0]
                tokens = len(completion.token_ids)
                if params.logprobs is not None and completion.delta_token_ids:
                    # Every new token's log-probabilities, in the chunk of the text that came with them (text held
                    # back for a stop string comes later, with its own token's chunk).
                    start = tokens - len(completion.delta_token_ids)
                    offset = len(completion.text) - len(completion.delta_text)
                    yield chunk(completion.delta_text, logprobs=_logprobs(
                        completion.delta_token_ids, completion.logprobs[start:], params.logprobs, chat, offset))
                elif completion.delta_text:
                    yield text_chunk(completion.delta_text)
                if out.finished:
                    yield chunk(None, finish_reason=completion.finish_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": _usage(len(ids), tokens)})
    except Exception as error:  # the stream has started: the status line is sent, so report in-band
        yield sse(engine_error(error).openai_body())
    yield "data: [DONE]\n\n"
