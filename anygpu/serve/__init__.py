"""The OpenAI- and TGI-compatible HTTP server (``anygpu serve``).

``build_app(engine)`` makes the ASGI app over an ``AsyncLLMEngine``; ``serve`` runs it in the foreground and
``ServerThread`` in a background thread.  Files: ``protocol`` (request schemas -> SamplingParams), ``errors``
(OpenAI / TGI error bodies), ``state`` (checks shared by all routes, admission, the engine stream),
``openai_api`` and ``tgi_api`` (the routes), ``metrics`` (Prometheus), ``app`` (assembly), ``runner`` (uvicorn).
"""

from .app import build_app
from .runner import ServerThread, bind, serve

__all__ = ["ServerThread", "bind", "build_app", "serve"]
