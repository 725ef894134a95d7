"""How one failed request and a dead engine are told apart.

A request that fails inside a step (its sampling or its text raised) finishes alone: its last
``RequestOutput`` has ``finish_reason == "error"``, ``error`` (the message) and ``error_type``, and the engine
steps on for the others.  ``error_type`` is ``"invalid_request"`` when the failure was a ``ValueError`` (the
project's convention for bad input: the message names the field, and the request's own values are what a step
can trip on) and ``"internal"`` otherwise.  ``AsyncLLMEngine`` raises them as ``RequestInvalid`` (a
``ValueError``: a 4xx at the HTTP layer) and ``RequestFailed`` (a ``RuntimeError``: a 500).

``EngineDead`` is raised for every request once the engine itself has failed (a step that failed for every
sequence in it, a device error, a dead engine process): nothing more will be served.
"""

from __future__ import annotations

INVALID_REQUEST, INTERNAL = "invalid_request", "internal"


class RequestInvalid(ValueError):
    """One request failed inside a step because of its own values."""


class RequestFailed(RuntimeError):
    """One request failed inside a step for a reason of the engine's; the others went on."""


class EngineDead(RuntimeError):
    """The engine has stopped after an error; no request will be served any more."""


def classify(error: BaseException) -> tuple[str, str]:
    """(error_type, message) for an exception that failed one request."""
    if isinstance(error, ValueError):
        return INVALID_REQUEST, str(error)
    return INTERNAL, f"{type(error).__name__}: {error}"


def as_exception(request_id: str, error_type: str | None, message: str | None) -> Exception:
    """What the stream of a request that finished with ``finish_reason == "error"`` raises."""
    cls = RequestInvalid if error_type == INVALID_REQUEST else RequestFailed
    return cls(message or f"request {request_id} failed")
