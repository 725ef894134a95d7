"""TGI's native routes: ``/generate`` (one JSON answer) and ``/generate_stream`` (server-sent events, one per
token; the last carries ``generated_text`` and ``details``; no ``[DONE]``, as in TGI), ``/`` (what TGI's own
clients, ``text_generation.Client`` and ``huggingface_hub.InferenceClient.text_generation``, post to: the body's
``stream`` picks the stream, else ``/generate``'s answer in a one-element list, as TGI does), and ``/info``.

TGI's conventions, kept so its clients work unchanged: validation errors are 422 with
``{"error", "error_type"}``; ``max_new_tokens`` defaults to 100; decoding is greedy unless ``do_sample`` or a
sampling warper (temperature, top_k, top_p) is given; ``truncate`` keeps the last N prompt tokens;
finish reasons are ``length``, ``eos_token`` and ``stop_sequence``.  Token log-probabilities are not
computed (``logprob: null``).
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .._version import __version__
from ..engine.protocol import MAX_STOP_STRINGS
from .metrics import RequestTimer
from .schemas import GenerateRequest
from .server import EngineStream, Server, engine_error, sse

TGI_PATHS = ("/", "/generate", "/generate_stream", "/info")


def _finish_reason(done, eos_ids) -> str:
    """TGI's finish reason for a finished ``CompletionOutput``."""
    if done.finish_reason == "length":
        return "length"
    if isinstance(done.stop_reason, str):
        return "stop_sequence"
    return "eos_token" if done.token_ids and done.token_ids[-1] in eos_ids else "stop_sequence"


def add_tgi_routes(app: FastAPI, server: Server) -> None:
    eos_ids = server.engine.eos_token_ids

    async def prepare(request: Request, body: GenerateRequest | None = None):
        arrival = time.monotonic()
        if body is None:
            server.authorize(request)
            body = await server.read_body(request, GenerateRequest, tgi=True)
        p = body.parameters
        p.check_supported()
        ids = server.tokenize(body.inputs, "inputs", status=422)
        if p.truncate is not None:
            ids = ids[-p.truncate:]
        max_tokens = server.limit_tokens(ids, p.max_new_tokens, None, "inputs", "parameters.max_new_tokens",
                                         status=422)
        params = server.sampling(lambda: p.sampling_params(max_tokens), status=422)
        ticket = server.admit()
        return body, ids, params, RequestTimer(server.metrics, arrival), f"tgi-{uuid.uuid4().hex}", ticket

    def token(tid: int, text: str) -> dict:
        return {"id": tid, "text": text, "logprob": None, "special": tid in eos_ids}

    @app.get("/info")
    async def info(request: Request):
        server.authorize(request)
        # TGI's fields (huggingface_hub's get_endpoint_info returns them); both names of the input limit, old
        # and new.  Not ours to say: the commit sha and Docker label (null).
        return {"model_id": server.model_name, "model_sha": None, "model_dtype": str(server.engine.dtype),
                "model_device_type": server.engine.device.type, "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": server.max_concurrent_requests, "max_best_of": 1,
                "max_stop_sequences": MAX_STOP_STRINGS, "max_input_tokens": server.max_model_len - 1,
                "max_input_length": server.max_model_len - 1, "max_total_tokens": server.max_model_len,
                "max_client_batch_size": 1, "validation_workers": 1, "version": __version__, "sha": None,
                "docker_label": None, "router": "anygpu"}

    @app.post("/")
    async def compat_generate(request: Request):
        server.authorize(request)
        body = await server.read_body(request, GenerateRequest, tgi=True)
        if body.stream:
            return await start_stream(request, body)
        answer = await answer_whole(request, body)
        return answer if isinstance(answer, JSONResponse) else [answer]

    @app.post("/generate")
    async def generate(request: Request):
        return await answer_whole(request)

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        return await start_stream(request)

    async def answer_whole(request: Request, body: GenerateRequest | None = None):
        body, ids, params, timer, request_id, ticket = await prepare(request, body)
        out = await server.complete(request, request_id, ids, params, timer, ticket)
        if out is None:
            return JSONResponse({}, status_code=499)
        done = out.outputs[0]
        text = (body.inputs + done.text) if body.parameters.return_full_text else done.text
        answer = {"generated_text": text}
        if body.parameters.details:
            tok = server.tokenizer
            answer["details"] = {
                "finish_reason": _finish_reason(done, eos_ids), "generated_tokens": len(done.token_ids),
                "seed": params.seed, "prefill": [],
                "tokens": [token(t, tok.decode([t], skip_special_tokens=False) if tok else "") for t in done.token_ids]}
        return answer

    async def start_stream(request: Request, body: GenerateRequest | None = None):
        body, ids, params, timer, request_id, ticket = await prepare(request, body)
        return EngineStream(_stream(body, ids, params, timer, request_id, ticket), ticket)

    async def _stream(body, ids, params, timer, request_id, ticket):
        index = 0
        try:
            async with server.stream(request_id, ids, params, timer, ticket) as outputs:
                async for out in outputs:
                    done = out.outputs[0]
                    new = done.delta_token_ids
                    for i, tid in enumerate(new):
                        index += 1
                        # A step brings one token; its text is the delta (text held back for a stop string
                        # or an incomplete character arrives with a later token).
                        event = {"index": index, "token": token(tid, done.delta_text if i == len(new) - 1 else ""),
                                 "top_tokens": None, "generated_text": None, "details": None}
                        if out.finished and i == len(new) - 1:
                            full = (body.inputs + done.text) if body.parameters.return_full_text else done.text
                            event["generated_text"] = full
                            event["details"] = {"finish_reason": _finish_reason(done, eos_ids),
                                                "generated_tokens": len(done.token_ids), "seed": params.seed,
                                                "input_length": len(ids)}
                        yield sse(event)
        except Exception as error:
            yield sse(engine_error(error).tgi_body())
