"""Parallel sampling (``SamplingParams.n`` > 1), vLLM V1's way: a request for n completions runs as n child
requests of one completion each, and their outputs are merged into one ``RequestOutput`` whose ``outputs[i]``
is child i's completion (``index`` i).  ``LLM.generate`` and ``AsyncLLMEngine.generate`` fan out; ``LLMEngine``
itself runs one completion per request (it refuses n > 1, so a caller cannot silently get one).

Child 0 starts first and the others once it has its first token: its prompt's full blocks are then computed
and in the prefix cache, so the others share them instead of computing and holding the prompt n times (they
start one step later).  ``RequestOutput.num_cached_tokens`` is then the largest of the children's.

Seeds: with ``seed`` set, child i samples with ``seed + i`` (vLLM's rule, wrapped to 64 bits): the choices
differ, the request is reproducible, and choice 0 is what n = 1 gives with the same seed.  Without a seed
every child draws from the global generator.  Prompt log-probabilities do not depend on sampling, so only
child 0 computes them and the merged output carries child 0's.
"""

from __future__ import annotations

import dataclasses

from .llm_engine import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

SEED_MASK = 2**64 - 1


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """One-completion params for each of ``params.n`` children."""
    children = []
    for i in range(params.n):
        changes: dict = {"n": 1}
        if i and params.seed is not None:
            changes["seed"] = (params.seed + i) & SEED_MASK
        if i:
            changes["prompt_logprobs"] = None
        children.append(params.clone(**changes))
    return children


class ParentRequest:
    """The merged view of n children: ``add`` each child output as it comes, ``output()`` the parent's
    ``RequestOutput`` (its completions' deltas: what arrived since the previous ``output()``)."""

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.latest: list[RequestOutput | None] = [None] * n
        self._unsent: list[tuple[str, list[int]]] = [("", [])] * n

    def add(self, index: int, out: RequestOutput) -> None:
        text, ids = self._unsent[index]
        c = out.outputs[0]
        self._unsent[index] = (text + c.delta_text, ids + list(c.delta_token_ids))
        self.latest[index] = out

    @property
    def finished(self) -> bool:
        return all(o is not None and o.finished for o in self.latest)

    def output(self) -> RequestOutput:
        seen = [o for o in self.latest if o is not None]
        completions = []
        for i, out in enumerate(self.latest):
            text, ids = self._unsent[i]
            if out is None:
                completions.append(CompletionOutput(i))
            else:
                completions.append(dataclasses.replace(out.outputs[0], index=i, delta_text=text, delta_token_ids=ids))
        self._unsent = [("", [])] * len(self.latest)
        failed = next((o for o in seen if o.error is not None), None)
        first = self.latest[0] or seen[0]
        started = [o.first_token_time for o in seen if o.first_token_time is not None]
        return RequestOutput(
            self.request_id, first.prompt_token_ids, completions, finished=self.finished, prompt=first.prompt,
            prompt_logprobs=self.latest[0].prompt_logprobs if self.latest[0] is not None else None,
            error=failed.error if failed else None, error_type=failed.error_type if failed else None,
            arrival_time=min(o.arrival_time for o in seen), first_token_time=min(started) if started else None,
            finish_time=max(o.finish_time or 0.0 for o in seen) if self.finished else None,
            num_cached_tokens=max(o.num_cached_tokens for o in seen))

    @property
    def rest_may_start(self) -> bool:
        """Child 0 has its first output (so its prompt blocks are cached) and did not fail."""
        first = self.latest[0]
        return first is not None and first.error is None
