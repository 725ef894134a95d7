"""The HTTP app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, TGI's
``/`` (its clients' route), ``/generate``, ``/generate_stream`` and ``/info``, ``/tokenize`` (TGI's and vLLM's
shapes), vLLM's ``/detokenize`` and ``/version``, plus ``/health`` and ``/metrics``.

    app = build_app(AsyncLLMEngine(LLMEngine(...)), api_key="...")   # then run it: anygpu.serve.run

Errors: ``APIError`` from any route becomes OpenAI's error body (TGI's on TGI routes); unknown routes and
methods, and unexpected exceptions, get the same shape (a 500 never shows a traceback to the client).
``/health`` and ``/metrics`` need no API key (probes and scrapers), nor do the API's description,
``/openapi.json``, its browsable page, ``/docs``, and ``/version`` (they show no secret); every other route does
when one is set.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._version import __version__
from ..engine.protocol import EngineProtocol
from .auth import key_problem
from .errors import APIError
from .openai_api import add_openai_routes
from .openapi import install as install_openapi
from .server import Server
from .tgi_api import TGI_PATHS, add_tgi_routes
from .tokens_api import add_token_routes

log = logging.getLogger("anygpu.serve")

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: a 100k-token prompt is ~400 KB of text
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024


def build_app(engine: EngineProtocol, *, model_name: str | list[str] | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
              strict_model_name: bool = False) -> FastAPI:
    """``model_name``: the names clients may send (a list, or a comma list; the first is reported), default the
    model's own name; ``strict_model_name``: unknown names get 404 instead of being taken for the served model
    (``names.py`` has the policy)."""
    for name, value in (("max_body_bytes", max_body_bytes), ("max_concurrent_requests", max_concurrent_requests)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if api_key is not None and key_problem(api_key):
        raise ValueError(f"api_key: {key_problem(api_key)}, or None for no auth")
    if not isinstance(strict_model_name, bool):
        raise ValueError(f"strict_model_name: expected True or False, got {strict_model_name!r}")
    server = Server(engine, model_name, api_key, max_body_bytes, max_concurrent_requests, strict_model_name)
    app = FastAPI(title="anygpu", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.server = server

    def tgi(request: Request) -> bool:
        return request.url.path in TGI_PATHS

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response(tgi=tgi(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(error.status_code)
        return APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", None,
                        code, dict(error.headers or {})).response(tgi=tgi(request))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error ({type(error).__name__}); see the server log", None,
                        "internal_error").response(tgi=tgi(request))

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"error": "the engine stopped after an error", "error_type": "healthcheck"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": server.created,
                                            "owned_by": "anygpu", "root": server.model_name,
                                            "max_model_len": server.max_model_len} for name in server.names.names]}

    add_openai_routes(app, server)
    add_tgi_routes(app, server)
    add_token_routes(app, server)
    install_openapi(app)
    return app
