"""The API's OpenAPI description (``/openapi.json``, browsable at ``/docs``), with the request bodies and the
answers the routes really give.

The routes read their bodies themselves (``Server.read_body``: a size limit first, then strict parsing into
the ``schemas`` models), so FastAPI cannot see them; this fills in each POST route's body from its model, the
content types of its 200 (JSON, or server-sent events when streamed) and its error shape, OpenAI's or TGI's.
The fuzz test (tests/test_serve_fuzz.py) generates requests from this description and checks answers against
it, so what it says is what is tested.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, TokenizeRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/generate": GenerateRequest, "/generate_stream": GenerateRequest, "/": GenerateRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
STREAMED = {"/v1/completions", "/v1/chat/completions", "/generate_stream", "/"}
TGI = {"/", "/generate", "/generate_stream", "/info", "/health"}  # TGI-shaped errors (/health: TGI's 503 body)
# The JSON 200s that are not one object: TGI's ``/`` answers a one-element list, ``/tokenize`` a list (TGI's
# shape) or an object (vLLM's).
JSON_200 = {"/": {"type": "array", "items": {"type": "object"}}, "/tokenize": {"type": ["array", "object"]}}

_REF = "#/components/schemas/{model}"
OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
TGI_ERROR = {"type": "object", "required": ["error", "error_type"],
             "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}

# One server-sent event (OpenAPI 3.1 describes each event of a stream with the media type's schema): ``data`` is
# a JSON chunk, or ``[DONE]`` at the end of an OpenAI stream.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"},
                                                                    "event": {"type": "string"}}}


def _errors(path: str) -> dict:
    schema = {"$ref": "#/components/schemas/TGIError" if path in TGI else "#/components/schemas/OpenAIError"}
    content = {"application/json": {"schema": schema}}
    return {"4XX": {"description": "The request was refused (the body names the field)", "content": content},
            "5XX": {"description": "The engine failed or is unavailable", "content": content}}


def describe(app: FastAPI) -> dict:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                       description="OpenAI- and TGI-compatible text generation (anygpu serve).")
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    components["OpenAIError"], components["TGIError"] = OPENAI_ERROR, TGI_ERROR
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            ok = {"application/json": {"schema": JSON_200.get(path, {"type": "object"})}}
            if path in BODIES and method == "post":
                model = BODIES[path]
                schema = model.model_json_schema(ref_template=_REF)
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            if path in STREAMED:
                ok["text/event-stream"] = {"schema": SSE_EVENT}
            if path == "/metrics":
                ok = {"text/plain": {"schema": {"type": "string"}}}
            op["responses"] = {"200": {"description": "OK", "content": ok}, **_errors(path)}
    return spec


def install(app: FastAPI) -> None:
    """Serve ``describe(app)`` (built once, on the first request for it) as the app's OpenAPI document."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = describe(app)
        return app.openapi_schema

    app.openapi = openapi
