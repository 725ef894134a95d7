"""Guided decoding (structured output): ``SamplingParams.guided_json`` constrains a request's tokens to JSON that
matches a schema, through llguidance's grammar engine (no hand-written parser).

- ``check_guided_json(value)``: the schema normalised to a dict, or a ValueError naming ``guided_json``.  The
  schema is compiled to a grammar and validated here (no tokenizer needed), so a bad schema is refused when the
  request is made, before it reaches the engine.
- ``GuideFactory(tokenizer, vocab_size, eos_ids)``: one per engine; ``new(schema)`` gives a ``Guide``, the
  matcher of one sequence.  The llguidance view of the tokenizer is built on the first guided request only, so
  requests without a schema cost nothing.
- ``Guide.bitmask()``: the tokens the grammar allows next (``mask_logits`` applies a batch's); ``advance(token)`` moves the
  matcher on the sampled token; ``done``: the grammar is complete (the request then stops, finish_reason "stop").

JSON is written in one fixed layout: no free whitespace, ``", "`` between items and ``": "`` after keys (Python's
``json.dumps`` style).  Free whitespace would let a model pad forever with spaces and newlines and run into
``max_tokens`` with unparseable output; a fixed layout cannot.  JSON mode (``{"type": "json_object"}``) is the
schema ``{"type": "object"}``.

Bounds, so one request cannot hold up the engine: the schema is at most ``MAX_SCHEMA_CHARS`` characters as JSON,
and llguidance's own parser limits (``LIMITS``) bound the grammar's size and the work of building its lexer and of
each token's mask; past them the request is refused (or, mid-request, fails alone with ``finish_reason="error"``).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import torch

MAX_SCHEMA_CHARS = 65536
JSON_OBJECT_SCHEMA = {"type": "object"}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's defaults (documented in its LLParserLimits): a grammar of at most 500,000 symbols, lexer building
# and each token's mask bounded by "fuel"; spelled out so they are ours to document and tune.
LIMIT_VALUES = dict(max_grammar_size=500_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                    step_max_items=50_000, max_lexer_states=250_000, verbose_errors=False)


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a dependency of the package; only a broken install lacks it
        raise ValueError("guided_json: structured output needs the llguidance package (pip install llguidance)") \
            from None
    return llguidance


def _limits():
    return _llguidance().LLParserLimits(**LIMIT_VALUES)


def _grammar(schema: dict) -> str:
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as error:
        raise ValueError(f"guided_json: not a usable JSON schema ({error})") from None


def check_guided_json(value) -> dict:
    """The schema (a dict, or JSON text of one) as a dict, validated; else ValueError naming guided_json."""
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:
            raise ValueError(f"guided_json: expected a schema of at most {MAX_SCHEMA_CHARS} characters, "
                             f"got {len(value)}")
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"guided_json: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"guided_json: expected a JSON schema (an object), got {type(value).__name__}")
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:  # not JSON data (a set, a NaN, a cycle...)
        raise ValueError(f"guided_json: the schema is not JSON data ({error})") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"guided_json: expected a schema of at most {MAX_SCHEMA_CHARS} characters as JSON, "
                         f"got {len(text)}")
    error = _llguidance().LLMatcher.validate_grammar(_grammar(value), limits=_limits())
    if error:
        raise ValueError(f"guided_json: not a usable JSON schema ({error[:500]})")
    return value


class Guide:
    """One sequence's matcher: the tokens allowed next, and the grammar's state after each sampled token."""

    def __init__(self, matcher):
        self._matcher = matcher

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ValueError(f"guided_json: the grammar failed ({self._matcher.get_error()[:500]})")

    def bitmask(self) -> bytes:
        """The tokens the grammar allows next, one bit each (token i: bit i % 8 of byte i // 8)."""
        self._check()
        mask = self._matcher.compute_bitmask()
        self._check()  # a mask past the step limits puts the matcher in its error state
        return mask

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            self._check()
            raise ValueError(f"guided_json: token {token} is not allowed by the grammar")

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()


class GuideFactory:
    """Builds the matchers of one engine's guided requests (the tokenizer's llguidance view is made once)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def _tokenizer_view(self):
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise ValueError("guided_json: this engine has no tokenizer (structured output needs one)")
                llg = _llguidance()
                # The tokenizer.json text: llguidance reads the same HF tokenizers model ours is built on.
                self._ll_tokenizer = llg.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                                                     eos_token=self._eos or None)
            return self._ll_tokenizer

    def new(self, schema: dict) -> Guide:
        llg = _llguidance()
        matcher = llg.LLMatcher(self._tokenizer_view(), _grammar(schema), log_level=0, limits=_limits())
        guide = Guide(matcher)
        guide._check()
        return guide


def mask_logits(logits: torch.Tensor, seqs) -> torch.Tensor:
    """The logits with each guided row's disallowed tokens at -inf (a new tensor; unguided rows unchanged)."""
    rows = [i for i, s in enumerate(seqs) if s.guide is not None]
    if not rows:
        return logits
    batch, vocab = logits.shape
    masks = [seqs[i].guide.bitmask() for i in rows]
    width = max(map(len, masks))
    packed = np.frombuffer(b"".join(m.ljust(width, b"\0") for m in masks), dtype=np.uint8).reshape(len(rows), width)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].view(bool)  # one unpack for all rows
    if bits.shape[1] < vocab:  # ids past the grammar's vocabulary are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    if not bits.any(axis=1).all():  # raised for the batch: the sampler then samples row by row, only this row fails
        raise ValueError("guided_json: the grammar allows no next token")
    # Only the guided rows' masks go to the device: a large batch with one guided request moves one row.
    allowed = torch.from_numpy(bits).to(logits.device)
    if len(rows) == batch:
        return torch.where(allowed, logits, -torch.inf)
    index = torch.tensor(rows, device=logits.device)
    return logits.index_put((index,), torch.where(allowed, logits[index], -torch.inf))
