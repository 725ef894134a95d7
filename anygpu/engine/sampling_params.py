"""``SamplingParams``: how one request is decoded, with vLLM's field names and defaults.

Checked when built (``__post_init__``) and again by the engine with the model's vocabulary size
(``validate(vocab_size)``), so a bad request fails at ``add_request`` with a ``ValueError`` that names the
field and says what was expected, never inside a step where it would take the whole batch down.

Normalisations: ``stop`` given as one string becomes a one-element list; tuples become lists; integral and
real numbers of other types (numpy scalars) become ``int`` / ``float``.  ``bool`` is refused where a number
is expected (``True`` is an ``int`` in Python, but ``max_tokens=True`` is a mistake, not 1).

Limits, so that no one request can overflow the sampler or slow the steps of the others:

- ``seed``: a 64-bit integer, ``-2**63 <= seed < 2**64`` (vLLM's signed and TGI's unsigned range; torch's
  generators take exactly these).  A negative seed is read as its two's complement, as torch reads it, so
  ``-1`` and ``2**64 - 1`` give the same tokens.
- ``top_k``: -1 or 0 (off) or ``1 <= top_k <= MAX_TOP_K``, and at most the vocabulary size once it is known
  (``validate(vocab_size)``; the sampler also treats a larger k as "off").
- ``stop``: at most ``MAX_STOP_STRINGS`` strings of 1 to ``MAX_STOP_STRING_CHARS`` characters (OpenAI allows 4,
  TGI 4 by default): every stop string is searched at every token, and the longest one sets how much text a
  stream holds back.  ``stop_token_ids``: at most ``MAX_STOP_TOKEN_IDS`` ids (each is compared at every token).
- ``n``: at most ``MAX_N`` completions per request (each is a sequence of its own, see ``parallel_sampling.py``).
  ``logprobs`` and ``prompt_logprobs``: at most ``MAX_LOGPROBS`` most likely tokens per position.
- ``guided_json``: a JSON schema (a dict, or its JSON text) the output must match, enforced token by token
  (``guided.py``: at most ``MAX_SCHEMA_CHARS`` characters, compiled and checked here).  JSON mode, any JSON
  object, is ``guided_json={"type": "object"}``.  vLLM's name (its server's ``guided_json`` extension).
- The other numbers have OpenAI's / vLLM's ranges: temperature >= 0 and finite, top_p in (0, 1], min_p in [0, 1],
  presence and frequency penalties in [-2, 2], repetition_penalty > 0 and finite, max_tokens >= 1 (bounded by
  the context by the engine's scheduler and the server).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from .guided import check_guided_json

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's range
MAX_TOP_K = 2**31 - 1                     # TGI's (an i32); no vocabulary comes near
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound; each is a top-k over the vocabulary at every token
MAX_N = 16  # completions per request: each one is a sequence, so n multiplies what one request holds


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _short(value, limit: int = 200) -> str:
    """repr(value) cut to ``limit`` characters: an error message must not echo a megabyte of request back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _real(name: str, value, ok, expected: str) -> float:
    """value as a float when it is a real number (not NaN) for which ok(value) holds, else ValueError."""
    if not _is_real(value) or math.isnan(value) or not ok(value):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None: until EOS or the context length
    temperature: float = 1.0             # 0 = greedy (argmax)
    top_k: int = 0                       # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0      # over prompt + output tokens (HF/vLLM semantics)
    presence_penalty: float = 0.0        # over output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)          # stop strings (not included in the output text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None          # None: none; k: each token's log-probability and the k most likely
    n: int = 1                           # completions of the prompt (parallel sampling)
    prompt_logprobs: int | None = None   # as logprobs, for the prompt's tokens (the first has none)
    guided_json: dict | str | None = None  # a JSON schema the output must match (guided.py); None: free text

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field; normalise the good ones in place."""
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens) or self.max_tokens < 1:
                raise ValueError(f"max_tokens: expected an int >= 1 or None, got {self.max_tokens!r}")
            self.max_tokens = int(self.max_tokens)
        self.temperature = _real("temperature", self.temperature, lambda v: 0 <= v < math.inf,
                                 "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k: expected an int in [1, {MAX_TOP_K}], or 0 or -1 for off, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k: expected at most the vocabulary size {vocab_size} (or 0 or -1 for off), "
                             f"got {self.top_k}")
        self.top_p = _real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")
        self.min_p = _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]")
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty,
                                        lambda v: 0 < v < math.inf, "a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _real(name, getattr(self, name), lambda v: -2 <= v <= 2,
                                      "a number in [-2, 2]"))
        if self.seed is not None:
            if not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed: expected None or a 64-bit int in [-2**63, 2**64 - 1], got {self.seed!r}")
            self.seed = int(self.seed)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Counts first: a request with 400,000 stop strings is refused before anything walks them.
        if isinstance(self.stop, (list, tuple)) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: expected at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: expected a non-empty string or a list of them, got {_short(self.stop)}")
        self.stop = list(self.stop)
        too_long = [i for i, s in enumerate(self.stop) if len(s) > MAX_STOP_STRING_CHARS]
        if too_long:
            raise ValueError(f"stop: expected stop strings of at most {MAX_STOP_STRING_CHARS} characters, got "
                             f"{len(self.stop[too_long[0]])} in stop[{too_long[0]}]")
        if isinstance(self.stop_token_ids, (list, tuple)) and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: expected at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected a list of ints, got {_short(self.stop_token_ids)}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids: expected ids in [0, {vocab_size}) (the vocabulary), got {bad[:8]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name}: expected None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
                setattr(self, name, int(value))
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: expected an int in [1, {MAX_N}] (completions per request), got {self.n!r}")
        self.n = int(self.n)
        if self.guided_json is not None:
            self.guided_json = check_guided_json(self.guided_json)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")

    def clone(self, **changes) -> SamplingParams:
        """A validated copy with some fields changed (lists copied, so the copy can be edited alone)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["stop"], values["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        values.update(changes)
        return SamplingParams(**values)
