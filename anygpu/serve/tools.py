"""Tool calls on ``/v1/chat/completions`` in their simplest honest form: the client forces a call and the output
is constrained to the call's JSON (``engine/guided.py``), then returned in OpenAI's ``tool_calls`` shape.

- ``tool_choice: {"type": "function", "function": {"name": N}}``: the output is the JSON arguments of N (its
  ``parameters`` schema; none given: an object).
- ``tool_choice: "required"``: the output is ``{"name": ..., "arguments": {...}}`` for one of the tools (an
  ``anyOf`` over them), so the model picks the function and its arguments in one constrained answer.
- ``tool_choice: "none"``: plain text, as if no tools were given.
- ``tool_choice: "auto"`` (OpenAI's default when tools are given) is refused with a 400 naming ``tool_choice``:
  deciding whether to call needs the model's own tool-call syntax, parsed per model family; not done here.

The chat template is rendered without ``tools`` (SmolLM2's has no tool syntax), so the functions are described to
the model in a system message (``system_text``): their names, descriptions and parameter schemas as JSON, put
before the first system message's text (or as a new first message).  A finished answer becomes one call
(``calls``) with finish_reason ``"tool_calls"``; an answer cut by ``max_tokens`` is returned as text with
finish_reason ``"length"`` (its JSON is incomplete, so it is no call).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .errors import APIError

ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    schema: dict          # what the output is constrained to (SamplingParams.guided_json)
    name: str | None      # the forced function; None: the output names it ("required")
    system_text: str      # the functions, described to the model

    def calls(self, text: str) -> list[dict]:
        """OpenAI's ``tool_calls`` for a finished (grammar-complete, so parseable) answer."""
        if self.name is not None:
            name, arguments = self.name, text
        else:
            value = json.loads(text)
            name, arguments = value["name"], json.dumps(value["arguments"], ensure_ascii=False)
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": arguments}}]


def _described(tools) -> str:
    specs = [{"name": t.function.name, "description": t.function.description or "",
              "parameters": t.function.parameters or ANY_OBJECT} for t in tools]
    return ("You call a function by answering with its arguments as JSON. The functions:\n"
            + "\n".join(json.dumps(s, ensure_ascii=False) for s in specs))


def tool_plan(tools, tool_choice) -> ToolPlan | None:
    """The plan for a request's ``tools`` / ``tool_choice`` (None: plain text), or a 400 naming the field."""
    if tool_choice in (None, "none", "auto") and not tools:
        return None
    if not tools:
        raise APIError(400, "tool_choice: a function call was asked for, but no tools were given", "tool_choice")
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        raise APIError(400, "tool_choice: 'auto' (the default when tools are given) is not supported by this server; "
                            "send 'required' or {'type': 'function', 'function': {'name': ...}} to force a call, or "
                            "'none'", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", "tools")
    if tool_choice == "required":
        options = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                     "arguments": t.function.parameters or ANY_OBJECT},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        return ToolPlan(options[0] if len(options) == 1 else {"anyOf": options}, None, _described(tools))
    name = tool_choice.function.name
    if name not in names:
        raise APIError(400, f"tool_choice.function.name: {name[:100]!r} is not one of the tools' names",
                       "tool_choice.function.name")
    tool = tools[names.index(name)]
    return ToolPlan(tool.function.parameters or ANY_OBJECT, name, _described([tool]))
