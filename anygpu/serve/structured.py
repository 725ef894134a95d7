"""``response_format`` (OpenAI's JSON mode and JSON schema) and vLLM's ``guided_json`` as the engine's
``SamplingParams.guided_json``: the schema the output is constrained to, token by token (``engine/guided.py``).

- ``{"type": "text"}`` (or nothing): free text.
- ``{"type": "json_object"}``: any JSON object (the schema ``{"type": "object"}``).  OpenAI also asks the prompt to
  mention JSON; this server does not: the grammar guarantees the output is an object either way.
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON that matches the
  schema.  It is always enforced (``strict`` true or false: constrained decoding has no looser mode).

TGI's ``parameters.grammar`` of type ``json`` is the same schema (``tgi_grammar_schema``).

Every refusal is a 400 naming ``response_format`` (or the field inside it); a schema llguidance cannot compile
is refused here, before the request reaches the engine.
"""

from __future__ import annotations

from ..engine.protocol import JSON_OBJECT_SCHEMA, check_guided_json
from .errors import APIError


def checked_schema(schema, param: str, status: int = 400) -> dict:
    """check_guided_json's, its error a 400 (TGI: 422) naming ``param``."""
    try:
        return check_guided_json(schema)
    except ValueError as error:
        message = str(error).removeprefix("guided_json: ")
        raise APIError(status, f"{param}: {message}", param) from None


def tgi_grammar_schema(grammar) -> dict | None:
    """TGI's ``parameters.grammar``, ``{"type": "json", "value": schema}``, as the schema (422s as TGI's)."""
    if grammar is None:
        return None
    param = "parameters.grammar"
    if not isinstance(grammar, dict) or grammar.get("type") != "json":
        raise APIError(422, f"{param}: only {{'type': 'json', 'value': <JSON schema>}} is supported (no 'regex')",
                       param)
    return checked_schema(grammar.get("value"), f"{param}.value", status=422)


def response_format_schema(fmt: dict | None) -> dict | None:
    """The schema ``response_format`` asks for, None for free text; else a 400 naming the field."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(JSON_OBJECT_SCHEMA)
    if kind != "json_schema":
        raise APIError(400, f"response_format.type: expected 'text', 'json_object' or 'json_schema', got "
                            f"{str(kind)[:100]!r}", "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema: expected an object with 'name' and 'schema'",
                       "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise APIError(400, "response_format.json_schema.name: expected a string", "response_format.json_schema.name")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise APIError(400, "response_format.json_schema.strict: expected true or false",
                       "response_format.json_schema.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema: expected a JSON schema (an object)",
                       "response_format.json_schema.schema")
    return checked_schema(schema, "response_format.json_schema.schema")


def guided_schema(response_format: dict | None, guided_json) -> dict | None:
    """The request's schema from ``response_format`` or vLLM's ``guided_json`` (not both)."""
    schema = response_format_schema(response_format)
    if guided_json is None:
        return schema
    if schema is not None:
        raise APIError(400, "guided_json: give response_format or guided_json, not both", "guided_json")
    return checked_schema(guided_json, "guided_json")
