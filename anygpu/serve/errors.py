"""Errors as clients expect them.

OpenAI routes answer ``{"error": {"message", "type", "param", "code"}}`` with the status in the status line
(OpenAI's shape: ``code`` is a string id or null, never the HTTP status).  TGI routes answer TGI's own shape,
``{"error": str, "error_type": str}``, which its clients (``huggingface_hub``'s ``InferenceClient``) parse.

Every handler raises ``APIError``; the app turns it into the right body for the route's family.  Messages
start with the parameter they are about (``"temperature: ..."``), as the engine's ValueErrors already do, so
``param_of`` can recover the field from an engine error.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

# OpenAI's ``type``: every 4xx is the client's fault (``invalid_request_error``) unless named here; 5xx are ours.
_TYPES = {429: "rate_limit_error"}
# TGI's ``error_type``: its router says ``validation`` for bad input, ``overloaded`` for 429, ``generation`` for a
# failed generation; 4xx not named here are the client's request (``validation``).
_TGI_TYPES = {401: "authentication", 429: "overloaded", 500: "generation", 503: "unhealthy"}


def openai_type(status: int) -> str:
    return _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


def tgi_type(status: int) -> str:
    return _TGI_TYPES.get(status) or ("validation" if 400 <= status < 500 else "generation")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, tgi_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.tgi_type = tgi_type  # when the status alone does not say it (a 503 that is overload, not a dead engine)

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": openai_type(self.status),
                          "param": self.param, "code": self.code}}

    def tgi_body(self) -> dict:
        return {"error": self.message, "error_type": self.tgi_type or tgi_type(self.status)}

    def response(self, tgi: bool = False) -> JSONResponse:
        return JSONResponse(self.tgi_body() if tgi else self.openai_body(), status_code=self.status,
                            headers=self.headers)


_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def param_of(message: str) -> str | None:
    """The field a ``"field: what was expected"`` message names, else None."""
    m = _PARAM.match(message)
    return m.group(1) if m else None


def bad_request(error: ValueError, param: str | None = None, status: int = 400) -> APIError:
    """An engine or SamplingParams ValueError as a 400 naming its field (or ``param`` when given)."""
    message = str(error)
    return APIError(status, message, param or param_of(message))


def from_validation(error, tgi: bool = False) -> APIError:
    """A pydantic ValidationError as one APIError naming the first bad field (dotted path, list indexes)."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"body: malformed JSON ({first['msg']})", None, "invalid_json")
    loc = ".".join(str(p) for p in first["loc"])
    message = f"{loc}: {first['msg']}" if loc else f"body: {first['msg']}"
    return APIError(422 if tgi else 400, message, loc or None, first["type"])
