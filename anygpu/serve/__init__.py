"""The OpenAI- and TGI-compatible HTTP server (``anygpu serve``).

``build_app(engine)`` makes the ASGI app over an ``AsyncLLMEngine`` (any ``engine.protocol.EngineProtocol``:
the only engine module ``serve/`` imports); ``serve`` runs it in the foreground and ``ServerThread`` in a
background thread.  Files: ``schemas`` (request bodies -> SamplingParams; ``structured`` and ``tools``:
response_format and forced tool calls as guided decoding), ``errors`` (OpenAI / TGI error bodies), ``server``
(checks shared by all routes, admission, the engine stream), ``openai_api`` and ``tgi_api`` (the routes),
``metrics`` (Prometheus), ``app`` (assembly), ``runner`` (uvicorn),
``limits`` and ``edge`` (the HTTP edge: head sizes, read deadlines, the connection cap).

The names below load on first use: ``anygpu serve --help`` reads ``limits`` without importing FastAPI.
"""

from __future__ import annotations

import importlib

_WHERE = {"build_app": ".app", "ServerThread": ".runner", "bind": ".runner", "serve": ".runner",
          "EdgeLimits": ".limits"}

__all__ = ["EdgeLimits", "ServerThread", "bind", "build_app", "serve"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
