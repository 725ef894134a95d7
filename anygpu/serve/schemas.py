"""Request bodies of the OpenAI and TGI routes, and how each becomes ``SamplingParams``.

Parsed with pydantic in strict JSON mode: a number sent as a string, a bool where an int is expected or a
float where an int is expected is an error naming the field (lax coercion would run a request the client
did not write).  Unknown fields are ignored, as OpenAI's own API does; fields we know but do not implement
(``logit_bias``, ``best_of``, ...) are refused with a 400 naming them rather than silently dropped.

Every number is bounded here, so the OpenAPI schema shows the ranges and nothing out of range reaches the
engine (the engine's ``SamplingParams`` checks the same bounds again, and ``top_k`` against the vocabulary):

- OpenAI's ranges: temperature 0-2, top_p in (0, 1], presence/frequency penalties in [-2, 2], logit_bias values
  in [-100, 100], top_logprobs 0-20; TGI's: temperature > 0, top_p in (0, 1), typical_p in (0, 1).
- Floats are finite: JSON's ``NaN`` and ``Infinity`` (which pydantic reads by default) are refused.
- Counts of tokens (``max_tokens``, ``max_new_tokens``, ``truncate``, ``best_of``) and ``top_k`` are at
  most 2**31 - 1 (TGI's i32); the model's context bounds the token counts further (``Server.limit_tokens``).
  ``max_tokens`` may be 0 on ``/v1/completions`` with ``echo`` (the prompt scored, nothing generated).
- ``n``: 1 to ``MAX_N`` (16) completions per request (each is a sequence in the engine).
- ``seed``: 64-bit: [-2**63, 2**64 - 1] on the OpenAI routes (vLLM's signed and TGI's unsigned range), TGI's
  u64 [0, 2**64 - 1] on ``/generate``.
- ``stop``: at most 64 strings of 1 to 256 characters; ``stop_token_ids``: at most 256 ids
  (``SamplingParams``' limits: each is checked at every token, so they bound what one request costs the others).

vLLM's extensions that a client may send through ``extra_body`` are accepted: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, and ``guided_json`` (a JSON schema, as ``response_format``'s: ``structured.py``).
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ..engine.protocol import (MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                               MAX_TOP_K, SEED_MAX, SEED_MIN, SamplingParams)
from .errors import APIError
from .structured import checked_schema, guided_schema, tgi_grammar_schema
from .tools import ToolPlan, tool_plan

MAX_COUNT = 2**31 - 1  # token counts: TGI's i32; the context bounds them further
MAX_TOOLS = 128  # OpenAI's limit on tools per request

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_COUNT)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
# A string or a list: tagged, so an error names the branch the value took ("stop.list: ... at most 64 items")
# instead of first reporting that a list is not a string.
Stop = Annotated[Union[Annotated[StopString, Tag("string")], Annotated[StopList, Tag("list")]],
                 Discriminator(lambda v: "string" if isinstance(v, str) else "list")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    """Fields the two OpenAI routes share."""

    model: str | None = None  # None: the served model (see Server.check_model for the name policy)
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output (structured.py): OpenAI's response_format, or vLLM's guided_json (a JSON schema).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """``SamplingParams`` for this body; ``max_tokens`` is the route's resolved limit."""
        values = dict(max_tokens=max_tokens, seed=self.seed, ignore_eos=self.ignore_eos,
                      skip_special_tokens=self.skip_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty", "stop_token_ids"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.stop is not None:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(**values, logprobs=self.logprob_count, prompt_logprobs=self.prompt_logprob_count,
                              n=self.n or 1, guided_json=self.guided_schema())

    def guided_schema(self) -> dict | None:
        """The JSON schema the output is constrained to, or None (a 400 naming the field if unusable)."""
        return guided_schema(self.response_format, self.guided_json)

    @property
    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: None for none, else how many most likely tokens to list per token."""
        raise NotImplementedError

    @property
    def prompt_logprob_count(self) -> int | None:
        """SamplingParams.prompt_logprobs: the same for the prompt's tokens (computed only when asked for)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None  # 0: with echo, score the prompt only
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # the legacy API's: how many top tokens
    echo: bool = False  # the prompt before the completion; with logprobs, the prompt's too (the first is null)
    best_of: Count | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 is only allowed with echo=true (the prompt and its log-probabilities "
                                "without a completion); expected at least 1", "max_tokens")
        for name, off in (("best_of", 1), ("suffix", None)):
            if getattr(self, name) not in (off, None):
                raise APIError(400, f"{name}: not supported by this server", name)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the engine generates one token (it always samples after the prompt), which
        the response leaves out, as vLLM does."""
        return self.echo and self.max_tokens == 0

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a string or token ids); a batch of several is refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: batches of prompts are not supported (got {len(p)}); send one "
                                    f"request per prompt", "prompt")
            p = p[0]
        if not p:
            raise APIError(400, "prompt: expected a non-empty string or list of token ids", "prompt")
        return p


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: bool | None = None  # calls are always constrained to the schema (tools.py)


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: only allowed when logprobs is true", "top_logprobs")
        if self.tool_plan is not None and self.logprobs:
            raise APIError(400, "logprobs: not supported together with a forced tool call", "logprobs")

    @cached_property
    def tool_plan(self) -> ToolPlan | None:
        """The forced tool call (tools.py), None for plain text; a 400 naming the field if refused."""
        return tool_plan(self.tools, self.tool_choice)

    def guided_schema(self) -> dict | None:
        plan = self.tool_plan
        if plan is None:
            return super().guided_schema()
        if (self.response_format or {}).get("type", "text") != "text" or self.guided_json is not None:
            raise APIError(400, "response_format: not allowed together with a forced tool call (the call's schema "
                                "is the format)", "response_format")
        return checked_schema(plan.schema, "tools")

    def template_messages(self) -> list[ChatMessage]:
        """The messages for the chat template: with a forced tool call, the functions described in the first
        system message (the template is rendered without ``tools``: tools.py)."""
        plan = self.tool_plan
        if plan is None:
            return self.messages
        first = self.messages[0]
        if first.role in ("system", "developer"):
            text = first.as_template_message()["content"]
            return [ChatMessage(role="system", content=f"{plan.system_text}\n\n{text}"), *self.messages[1:]]
        return [ChatMessage(role="system", content=plan.system_text), *self.messages]

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaced max_tokens in OpenAI's API; a client may send either.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- TGI -----------------------------------------------------------------------------------------------
class TGIParameters(_Body):
    do_sample: bool = False
    temperature: Annotated[float, Field(gt=0.0)] | None = None
    top_k: Annotated[int, Field(gt=0, le=MAX_TOP_K)] | None = None
    top_p: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    frequency_penalty: Penalty | None = None
    max_new_tokens: Count | None = 100  # TGI's default
    return_full_text: bool = False
    stop: StopList = Field(default_factory=list)
    truncate: Count | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    details: bool = False
    decoder_input_details: bool = False
    best_of: Count | None = None
    typical_p: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    watermark: bool = False
    top_n_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None
    grammar: Any = None
    adapter_id: str | None = None

    def check_supported(self) -> None:
        for name, off in (("decoder_input_details", False), ("best_of", 1), ("typical_p", None),
                          ("watermark", False), ("top_n_tokens", None), ("adapter_id", None)):
            if getattr(self, name) not in (off, None):
                raise APIError(422, f"parameters.{name}: not supported by this server", f"parameters.{name}")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        # TGI samples when asked to, or when any sampling warper is set; otherwise it decodes greedily.
        sample = self.do_sample or any(v is not None for v in (self.temperature, self.top_k, self.top_p))
        values = dict(max_tokens=max_tokens, temperature=(self.temperature or 1.0) if sample else 0.0,
                      stop=self.stop, seed=self.seed, guided_json=tgi_grammar_schema(self.grammar))
        if sample and self.top_k is not None:
            values["top_k"] = self.top_k
        if sample and self.top_p is not None:
            values["top_p"] = self.top_p
        if self.repetition_penalty is not None:
            values["repetition_penalty"] = self.repetition_penalty
        if self.frequency_penalty is not None:
            values["frequency_penalty"] = self.frequency_penalty
        return SamplingParams(**values)


class GenerateRequest(_Body):
    inputs: Annotated[str, Field(min_length=1)]
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


# -- tokenizer routes ----------------------------------------------------------------------------------
class TokenizeRequest(_Body):
    """``/tokenize`` in TGI's shape (``inputs``: a list of tokens with their text and offsets back) or vLLM's
    (``prompt`` or ``messages``: ``{"count", "max_model_len", "tokens"}`` back); exactly one of the three."""

    model: str | None = None
    inputs: str | None = None
    parameters: dict[str, Any] | None = None  # TGI sends its generate parameters along; tokenizing ignores them
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]
