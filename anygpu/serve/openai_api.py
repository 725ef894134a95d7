"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, streaming (server-sent events ending in
``data: [DONE]``) and not.

Defaults, as vLLM's: completions generate at most 16 tokens unless ``max_tokens`` says otherwise (OpenAI's
default); chat generates until EOS or the end of the context. A stream sends the assistant role first, then one
chunk per new piece of text, then a chunk with ``finish_reason``, then (with ``stream_options.include_usage``) a
chunk with ``choices: []`` and the usage; every earlier chunk then carries ``usage: null``. With ``n`` > 1 the
choices' chunks interleave, each naming its ``index``; usage counts the tokens of all choices. With ``echo``
(completions), each choice's first chunk is the prompt (with its log-probabilities when asked for: ``echo.py``).
With log-probabilities asked for, a chunk goes out for every step that brought tokens (its text may be empty
while a stop string is held back) and carries those tokens' log-probabilities (``logprobs.py``). An error after
the stream has started is sent as ``data: {"error": {...}}``, which OpenAI's client raises as an APIError.
``response_format`` constrains the text (``structured.py``); a forced tool call (``tools.py``) answers with
``tool_calls`` and finish_reason "tool_calls", streamed as one ``delta.tool_calls`` chunk once the call is complete.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .echo import Echo
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import RequestTimer
from .schemas import ChatCompletionRequest, CompletionRequest
from .server import EngineStream, Server, dumps, engine_error, sse
from .tools import ToolPlan

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
        prompt = body.single_prompt()
        ids = server.tokenize(prompt, "prompt")
        requested = 1 if body.echo_only else body.max_tokens
        max_tokens = server.limit_tokens(ids, requested, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt", "max_tokens")
        params = server.sampling(lambda: body.sampling_params(max_tokens))
        echo = Echo(server.tokenizer, prompt, ids, body.echo_only) if body.echo else None
        return await _respond(request, server, body, name, "cmpl", "text_completion", ids, params, arrival,
                              chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        server.authorize(request)
        body = await server.read_body(request, ChatCompletionRequest)
        name = server.check_model(body.model)
        body.check_supported()
        ids = server.chat_ids(body.template_messages())
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = server.limit_tokens(ids, body.requested_max_tokens, None, "messages", param)
        params = server.sampling(lambda: body.sampling_params(max_tokens))
        return await _respond(request, server, body, name, "chatcmpl", "chat.completion", ids, params, arrival,
                              chat=True, echo=None, tools=body.tool_plan)


async def _respond(request, server: Server, body, name: str, prefix: str, obj: str, ids, params, arrival: float,
                   chat: bool, echo: Echo | None, tools: ToolPlan | None = None):
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    ticket = server.admit()
    timer = RequestTimer(server.metrics, arrival)
    head = {"id": request_id, "object": obj, "created": int(time.time()), "model": name}
    if body.stream:
        return EngineStream(_stream(server, request_id, ids, params, timer, ticket, head, chat, body.include_usage,
                                    echo, tools), ticket)

    out = await server.complete(request, request_id, ids, params, timer, ticket)
    if out is None:  # the client left; nobody reads this
        return JSONResponse({}, status_code=499)
    choices, tokens = [], 0
    for done in out.outputs:
        if echo is not None:
            text, logprobs = echo.whole(done, out.prompt_logprobs, params.logprobs)
            tokens += 0 if echo.only else len(done.token_ids)
        else:
            text, logprobs = done.text, _logprobs(done.token_ids, done.logprobs, params.logprobs, chat)
            tokens += len(done.token_ids)
        message, reason = {"role": "assistant", "content": text}, done.finish_reason
        if tools is not None and reason == "stop":  # a complete call (a cut one stays text: tools.py)
            message, reason = {"role": "assistant", "content": None, "tool_calls": tools.calls(text)}, "tool_calls"
        choices.append({"index": done.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
                       if chat else
                       {"index": done.index, "text": text, "logprobs": logprobs, "finish_reason": done.finish_reason})
    return {**head, "object": obj, "choices": choices, "usage": _usage(len(ids), tokens)}


def _logprobs(token_ids, entries, k: int | None, chat: bool, offset: int = 0) -> dict | None:
    if k is None or entries is None:
        return None
    return chat_logprobs(token_ids, entries, k) if chat else completion_logprobs(token_ids, entries, k, offset)


def _tool_chunks(chunk, base: dict, index: int, completion, tools: ToolPlan):
    """A streamed choice's end under a forced tool call: the call in one delta and finish_reason "tool_calls",
    or (cut by max_tokens) its text and "length"."""
    if completion.finish_reason != "stop":
        if completion.text:
            yield chunk(index, completion.text)
        yield chunk(index, None, finish_reason=completion.finish_reason)
        return
    calls = [{"index": i, **call} for i, call in enumerate(tools.calls(completion.text))]
    yield sse({**base, "choices": [{"index": index, "delta": {"tool_calls": calls}, "logprobs": None,
                                    "finish_reason": None}]})
    yield chunk(index, None, finish_reason="tool_calls")


async def _stream(server: Server, request_id, ids, params, timer, ticket, head, chat: bool, include_usage: bool,
                  echo: Echo | None, tools: ToolPlan | None = None):
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {**head, "object": obj}
    if include_usage:
        base["usage"] = None

    def chunk(index: int, text: str | None, finish_reason=None, role: bool = False, logprobs=None):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**base, "choices": [choice]})

    # The chunk sent for every new piece of text, as a template per choice: at a few thousand chunks per second
    # on one event loop, building and serializing the whole dict each time is a measurable share of the server.
    templates = [chunk(i, "\x00").split(dumps("\x00")) for i in range(params.n)]

    def text_chunk(index: int, text: str) -> str:
        before, after = templates[index]
        return before + dumps(text) + after

    tokens, finished, shift = 0, set(), 0
    try:
        async with server.stream(request_id, ids, params, timer, ticket) as outputs:
            if chat:
                for i in range(params.n):
                    yield chunk(i, None, role=True)
            first = True
            async for out in outputs:
                if echo is not None and first:
                    prompt_logprobs = echo.prompt_logprobs(out.prompt_logprobs, params.logprobs)
                    for i in range(params.n):
                        yield chunk(i, echo.text, logprobs=prompt_logprobs)
                    shift = len(echo.text)
                first = False
                for completion in out.outputs:
                    index = completion.index
                    if tools is not None:  # a call goes out whole once complete: until then its JSON is partial
                        if completion.finish_reason is not None and index not in finished:
                            finished.add(index)
                            for line in _tool_chunks(chunk, base, index, completion, tools):
                                yield line
                        continue
                    if echo is None or not echo.only:
                        if params.logprobs is not None and completion.delta_token_ids:
                            # Every new token's log-probabilities, in the chunk of the text that came with them (text
                            # held back for a stop string comes later, with its own token's chunk).
                            start = len(completion.token_ids) - len(completion.delta_token_ids)
                            offset = shift + len(completion.text) - len(completion.delta_text)
                            yield chunk(index, completion.delta_text, logprobs=_logprobs(
                                completion.delta_token_ids, completion.logprobs[start:], params.logprobs, chat, offset))
                        elif completion.delta_text:
                            yield text_chunk(index, completion.delta_text)
                    if completion.finish_reason is not None and index not in finished:
                        finished.add(index)
                        yield chunk(index, None, finish_reason=completion.finish_reason)
                tokens = 0 if echo is not None and echo.only else sum(len(c.token_ids) for c in out.outputs)
        if include_usage:
            yield sse({**base, "choices": [], "usage": _usage(len(ids), tokens)})
    except Exception as error:  # the stream has started: the status line is sent, so report in-band
        yield sse(engine_error(error).openai_body())
    yield "data: [DONE]\n\n"
