"""``SamplingParams``: how one request is decoded, with vLLM's field names and defaults.

Checked when built (``__post_init__``) and again by the engine with the model's vocabulary size
(``validate(vocab_size)``), so a bad request fails at ``add_request`` with a ``ValueError`` that names the
field and says what was expected, never inside a step where it would take the whole batch down.

Normalisations: ``stop`` given as one string becomes a one-element list; tuples become lists; integral and
real numbers of other types (numpy scalars) become ``int`` / ``float``.  ``bool`` is refused where a number
is expected (``True`` is an ``int`` in Python, but ``max_tokens=True`` is a mistake, not 1).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


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
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: expected an int >= 1, or 0 or -1 for off, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        self.top_p = _real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")
        self.min_p = _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]")
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty,
                                        lambda v: 0 < v < math.inf, "a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _real(name, getattr(self, name), lambda v: -2 <= v <= 2,
                                      "a number in [-2, 2]"))
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValueError(f"seed: expected an int or None, got {self.seed!r}")
            self.seed = int(self.seed)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: expected a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected a list of ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids: expected ids in [0, {vocab_size}) (the vocabulary), got {bad}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")

    def clone(self, **changes) -> SamplingParams:
        """A validated copy with some fields changed (lists copied, so the copy can be edited alone)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["stop"], values["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        values.update(changes)
        return SamplingParams(**values)
