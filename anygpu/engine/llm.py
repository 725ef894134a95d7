"""``LLM``: the offline API, vLLM's shape.

    from anygpu import LLM, SamplingParams
    llm = LLM()                                            # the default model (SmolLM2-135M-Instruct), or a path
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    outs[0].outputs[0].text                                # vLLM's RequestOutput: .outputs[i].text, .token_ids,
    outs = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=64))   # .finish_reason

``generate`` takes raw prompts (strings or token-id lists) as they are, like vLLM; ``chat`` renders the model's
chat template first.  All prompts go into the engine at once and run with continuous batching; outputs come
back in prompt order, each a ``RequestOutput`` (``llm_engine.py``) with ``prompt`` (the text, when given as text),
``prompt_token_ids`` and ``outputs[0]`` (``text``, ``token_ids``, ``finish_reason``, ``stop_reason``; ``logprobs``
None).  A prompt that fails inside a step comes back finished with ``finish_reason="error"`` and ``error`` set
(``errors.py``); the others are unaffected.
"""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from .llm_engine import LLMEngine, RequestOutput
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
        added = []
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p)
                added.append(request_id)
        except Exception:
            for request_id in added:  # all or nothing: a bad prompt leaves no orphan running
                self.engine.abort(request_id)
            raise
        outputs = self._run(ids, use_tqdm)
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

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
