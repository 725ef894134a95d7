"""The tokenizer over HTTP: ``/tokenize`` in TGI's shape and in vLLM's, vLLM's ``/detokenize``, and ``/version``.

One ``/tokenize`` path serves both servers' clients, told apart by the body:

- TGI: ``{"inputs": str}`` -> ``[{"id", "text", "start", "stop"}, ...]``, the text of each token and its
  character offsets in ``inputs`` (special tokens the tokenizer adds have an empty span);
- vLLM: ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered with the chat template) ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``.

Ids are the ones ``/generate`` and ``/v1/completions`` would run for the same text.  Errors are OpenAI-shaped
(vLLM's routes), and 400 names the field.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from .._version import __version__
from .errors import APIError
from .schemas import DetokenizeRequest, TokenizeRequest
from .server import Server


def add_token_routes(app: FastAPI, server: Server) -> None:
    def tokenizer(param: str):
        if server.tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer", param)
        return server.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        server.authorize(request)
        body = await server.read_body(request, TokenizeRequest)
        server.check_model(body.model)
        given = [name for name in ("inputs", "prompt", "messages") if getattr(body, name) is not None]
        if len(given) != 1:
            raise APIError(400, f"body: expected exactly one of 'inputs' (TGI), 'prompt' or 'messages' (vLLM), "
                                f"got {given or 'none'}", given[1] if len(given) > 1 else None)
        if body.inputs is not None:
            return _tgi_tokens(tokenizer("inputs"), body.inputs)
        if body.prompt is not None:
            ids = tokenizer("prompt").encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            tokenizer("messages")
            ids = server.chat_ids(body.messages, body.add_generation_prompt)
        strs = [server.tokenizer.backend.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        server.authorize(request)
        body = await server.read_body(request, DetokenizeRequest)
        server.check_model(body.model)
        ids = server.tokenize(body.tokens, "tokens")  # checks the ids are in the vocabulary
        return {"prompt": tokenizer("tokens").decode(ids, skip_special_tokens=False)}

    @app.get("/version")
    async def version():
        return {"version": __version__}


def _tgi_tokens(tok, text: str) -> list[dict]:
    # The backend's encoding has the offsets; the ids are those of tok.encode (which may add BOS by hand).
    encoding = tok.backend.encode(text, add_special_tokens=True)
    ids = tok.encode(text)
    spans = list(zip(encoding.ids, encoding.offsets))
    inner = [i for i, _ in spans]
    if ids != inner:  # special tokens added around the backend's ids (BOS, EOS): empty spans at the ends
        head = next(k for k in range(len(ids) - len(inner) + 1) if ids[k:k + len(inner)] == inner)
        end = len(text)
        spans = [(i, (0, 0)) for i in ids[:head]] + spans + [(i, (end, end)) for i in ids[head + len(inner):]]
    return [{"id": i, "text": text[start:stop], "start": start, "stop": stop} for i, (start, stop) in spans]
