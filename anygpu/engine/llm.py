"""``LLM``: the offline API, vLLM's shape.

    from anygpu import LLM, SamplingParams
    llm = LLM()                                            # the default model (SmolLM2-135M-Instruct), or a path
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    outs[0].outputs[0].text                                # vLLM's RequestOutput: .outputs[i].text, .token_ids,
    outs = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=64))   # .finish_reason

``generate`` takes raw prompts (strings or token-id lists) as they are, like vLLM; ``chat`` renders the model's
chat template first.  All prompts go into the engine at once and run with continuous batching; outputs come
back in prompt order, each a ``RequestOutput`` (``llm_engine.py``) with ``prompt`` (the text, when given as text),
``prompt_token_ids`` and ``outputs[i]`` (``text``, ``token_ids``, ``finish_reason``, ``stop_reason``, ``logprobs``
with ``SamplingParams.logprobs``), one per ``SamplingParams.n`` (``parallel_sampling.py``), and
``prompt_logprobs`` with ``SamplingParams.prompt_logprobs``.  A prompt that fails inside a step comes back
finished with ``finish_reason="error"`` and ``error`` set (``errors.py``; with n > 1 its other completions are
aborted); the other prompts are unaffected.
"""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from .._progress import disabled
from .llm_engine import LLMEngine, RequestOutput
from .parallel_sampling import ParentRequest, child_id, child_params
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model=None, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: expected one per prompt ({len(prompts)}), "
                                 f"got {len(sampling_params)}")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added, families = [], {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params: expected SamplingParams, got {type(p).__name__}")
                # Child 0 now, the others once its prompt is in the prefix cache (parallel_sampling.py).
                families[request_id] = (prompt, child_params(p))
                self.engine.add_request(child_id(request_id, 0), prompt, families[request_id][1][0])
                added.append(child_id(request_id, 0))
        except Exception:
            for request_id in added:  # all or nothing: a bad prompt leaves no orphan running
                self.engine.abort(request_id)
            raise
        outputs = self._run(ids, families, use_tqdm)
        for out, prompt in zip(outputs, prompts):
            out.prompt = prompt if isinstance(prompt, str) else None
        return outputs

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """``messages``: one conversation (a list of {"role", "content"} dicts) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(conv) for conv in conversations]
        # The template writes BOS and the role markers itself: its text is encoded without adding specials.
        outputs = self.generate([self.tokenizer.encode(t, add_special_tokens=False) for t in texts],
                                sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def close(self) -> None:
        """Release the engine (with ``tp > 1``: stop its worker processes; garbage collection does it too)."""
        self.engine.close()

    def _run(self, ids: list[str], families: dict[str, tuple], use_tqdm: bool) -> list[RequestOutput]:
        parent_of = {child_id(request_id, i): (request_id, i)
                     for request_id, (_, children) in families.items() for i in range(len(children))}
        parents = {request_id: ParentRequest(request_id, len(children))
                   for request_id, (_, children) in families.items()}
        bar = tqdm(total=len(ids), desc="generating", disable=disabled(use_tqdm))
        left = set(ids)
        while left:
            for out in self.engine.step():
                if out.request_id not in parent_of:
                    continue
                request_id, i = parent_of[out.request_id]
                parent = parents[request_id]
                first = parent.latest[0] is None
                parent.add(i, out)
                prompt, children = families[request_id]
                if i == 0 and first and parent.rest_may_start:
                    for j in range(1, len(children)):
                        self.engine.add_request(child_id(request_id, j), prompt, children[j])
                if out.finished and out.error is not None:
                    self._abort_siblings(parent, [child_id(request_id, j) for j in range(len(children))])
                if request_id in left and parent.finished:
                    left.discard(request_id)
                    bar.update(1)
        bar.close()
        return [parents[i].output() for i in ids]

    def _abort_siblings(self, parent: ParentRequest, children: list[str]) -> None:
        """One completion failed: the request has failed, so its other completions stop now (as "abort")."""
        for i, child in enumerate(children):
            out = parent.latest[i]
            if out is not None and out.finished:
                continue
            self.engine.abort(child)
            if out is None:
                out = RequestOutput(child, parent.latest[next(j for j, o in enumerate(parent.latest) if o)]
                                    .prompt_token_ids)
            out.finished = True
            out.outputs[0].finish_reason = "abort"
            parent.latest[i] = out
