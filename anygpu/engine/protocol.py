"""The engine as the server sees it (vLLM's ``EngineClient`` idea): ``serve/`` imports this module and no other
of ``engine/``, so what the server may call is written down here, and an engine that keeps to it can be served
whatever it runs on (a thread of this process, its own process).  ``tests/test_engine_protocol.py`` holds
``serve/`` to that and checks each engine class against these protocols.

Three ``typing.Protocol``s (structural: the engines do not inherit from them, a class that has the members
satisfies them; so a missing member fails the tests instead of falling back to an empty default):

``EngineInfo`` -- what every engine answers, all three classes (``LLMEngine``, ``EngineClient``,
``AsyncLLMEngine``):
    the model it runs:  ``tokenizer`` (None for bare token ids), ``config`` (its ``ModelConfig``: the server
                        reads ``vocab_size``), ``model_name``, ``model_path`` (None for random weights),
                        ``max_model_len``, ``dtype``, ``device``, ``eos_token_ids`` (a frozenset)
    ``stats()``         an ``EngineStats`` snapshot: running and waiting requests, KV blocks in all and free
                        (``kv_cache_usage``); what ``/metrics`` reports
    ``healthy``         False once the engine has failed (a step raised, its process died); it stays False
    ``abort(id)``       stop a request and free its KV blocks; an unknown id is ignored

``EngineProtocol`` (``EngineInfo`` + ``generate``) -- what ``serve.build_app`` takes; ``AsyncLLMEngine``:
    ``generate(request_id, prompt, params)``  add a request and stream it: an async iterator of
                        ``RequestOutput``s.  Bad input raises ValueError from it; leaving it early aborts the
                        request (errors and engine death: ``async_engine.py``).

``StepEngine`` (``EngineInfo`` + the step-at-a-time calls) -- what ``AsyncLLMEngine`` drives; ``LLMEngine`` in
this process and ``EngineClient`` (``engine_process.py``) for one in its own process:
    ``add_request(request_id, prompt, params)``, ``has_unfinished()``, ``step()`` (the step's
    ``RequestOutput``s), ``close()``.

The request-level types the server builds and reads come from here too: ``SamplingParams`` and its limits,
``RequestOutput``, ``EngineStats``, and the guided-decoding schema check.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from .guided import JSON_OBJECT_SCHEMA, check_guided_json
from .llm_engine import RequestOutput
from .sampling_params import (MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                              MAX_TOP_K, SEED_MAX, SEED_MIN, SamplingParams)
from .stats import EngineStats

__all__ = ["EngineInfo", "EngineProtocol", "StepEngine", "EngineStats", "RequestOutput", "SamplingParams",
           "JSON_OBJECT_SCHEMA", "check_guided_json", "MAX_LOGPROBS", "MAX_N", "MAX_STOP_STRING_CHARS",
           "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS", "MAX_TOP_K", "SEED_MAX", "SEED_MIN"]


@runtime_checkable
class EngineInfo(Protocol):
    tokenizer: object
    config: object
    model_name: str
    model_path: object
    max_model_len: int
    dtype: object
    device: object
    eos_token_ids: frozenset

    def stats(self) -> EngineStats: ...

    @property
    def healthy(self) -> bool: ...

    def abort(self, request_id: str) -> None: ...


@runtime_checkable
class EngineProtocol(EngineInfo, Protocol):
    def generate(self, request_id: str, prompt, params: SamplingParams | None = None
                 ) -> AsyncIterator[RequestOutput]: ...


@runtime_checkable
class StepEngine(EngineInfo, Protocol):
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def close(self) -> None: ...
