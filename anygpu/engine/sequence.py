"""``Sequence``: one request's tokens and its place in the engine (status, KV blocks, computed tokens, timings).

The prompt and the output are separate lists: output tokens are appended one per step, and keeping them apart
makes ``num_prompt_tokens`` and the output free to read.  ``token_ids`` concatenates (a new list each call);
code on the hot path reads a slice with ``token_range``.

``num_computed_tokens`` is the scheduler's cursor: the tokens whose K/V are in the cache.  The step computes
tokens from there; once it reaches ``num_tokens`` the step's logits give the next token.  A sequence preempted
by recomputation goes back to 0 but keeps its output: the recomputation covers prompt and output tokens.

``block_table`` and ``block_hashes`` belong to the BlockManager; ``generator`` to the Sampler (a seeded
``torch.Generator`` made on first use, kept across steps and preemptions so a seed gives one stream).
Times (``arrival_time``, ``first_token_time``, ``finish_time``) are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import enum
import itertools
import time

from .sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # not holding KV blocks: new, or preempted
    RUNNING = enum.auto()   # holds KV blocks; computed a chunk or decoding
    FINISHED = enum.auto()  # finish_reason says why; blocks released


class Sequence:
    def __init__(self, prompt_token_ids, params: SamplingParams | None = None, seq_id: int | None = None,
                 arrival_time: float | None = None):
        self.prompt_token_ids: list[int] = [int(t) for t in prompt_token_ids]
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids: expected at least one token, got an empty prompt")
        self.seq_id: int = next(_ids) if seq_id is None else seq_id
        self.params: SamplingParams = SamplingParams() if params is None else params
        self.output_token_ids: list[int] = []
        # Sampler's, when params.logprobs is set: per output token (logprob, rank, [(id, logprob)] top-k).
        self.output_logprobs: list[tuple[float, int, list[tuple[int, float]]]] = []
        # The runner's, when params.prompt_logprobs is set: entry j is position j's prediction of prompt token j + 1,
        # in the same form; complete once it has num_prompt_tokens - 1 entries.
        self.prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None     # "stop" (EOS / id / string), "length", "abort", "error"
        self.num_computed_tokens = 0               # tokens whose K/V are in the cache
        self.num_cached_tokens = 0                 # of the prompt, found in the prefix cache (stats)
        self.num_preemptions = 0                   # stats
        self.block_table: list[int] = []           # BlockManager's: KV block of tokens [i*bs, (i+1)*bs)
        self.block_hashes: list[bytes] = []        # BlockManager's: chained hashes of the committed full blocks
        self.generator = None                      # Sampler's: torch.Generator for a seeded request
        self.guide = None                          # LLMEngine's: guided.Guide when params.guided_json is set
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token(self, i: int) -> int:
        """token_ids[i] (0 <= i < num_tokens) without building the whole list."""
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_range(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities asked for and not all computed yet (they need every prompt position run)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, finish_reason={self.finish_reason!r})")
