"""``echo`` on ``/v1/completions``: the prompt in front of each choice's text, and with ``logprobs`` the prompt
tokens' log-probabilities in front of the completion's, in OpenAI's legacy shape.  As OpenAI and vLLM do, the
first prompt token has no context to be predicted from, so its ``token_logprobs`` and ``top_logprobs`` entries
are null.

This is what log-likelihood evaluations read: lm-evaluation-harness's ``local-completions`` sends the context and
continuation as one prompt with ``echo``, ``logprobs=1`` and ``max_tokens`` 0 or 1, and sums ``token_logprobs``
over the continuation's positions.  ``max_tokens=0`` (``echo_only``) returns the prompt alone: the engine still
samples one token after the prompt, which is left out of the text, the log-probabilities and the usage (vLLM's
way).

The echoed text is the prompt as sent when it was a string, and its decoding (special tokens kept) when it was
token ids.  ``tokens`` are each prompt token's own text; ``text_offset`` counts their characters from 0, and the
completion's from the end of the echoed text.
"""

from __future__ import annotations

from .logprobs import completion_logprobs


class Echo:
    def __init__(self, tokenizer, prompt: str | list[int], ids: list[int], only: bool):
        self.ids = ids
        self.only = only
        self.tokenizer = tokenizer
        if isinstance(prompt, str):
            self.text = prompt
        else:
            self.text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else ""

    def prompt_logprobs(self, entries: list | None, k: int | None) -> dict | None:
        """The prompt's tokens in the legacy logprobs shape (``entries``: the engine's prompt_logprobs, one per
        prompt token, the first None), or None when log-probabilities were not asked for."""
        if k is None:
            return None
        if entries is None or len(entries) != len(self.ids):
            raise RuntimeError("echo: the engine returned no prompt log-probabilities for this request")
        first = self._token_text(self.ids[0])
        rest = completion_logprobs(self.ids[1:], entries[1:], k, offset=len(first))
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}

    def whole(self, completion, prompt_entries: list | None, k: int | None) -> tuple[str, dict | None]:
        """A finished choice's text and logprobs with the prompt in front."""
        if self.only:
            return self.text, self.prompt_logprobs(prompt_entries, k)
        text = self.text + completion.text
        if k is None:
            return text, None
        prompt = self.prompt_logprobs(prompt_entries, k)
        own = completion_logprobs(completion.token_ids, completion.logprobs, k, offset=len(self.text))
        return text, {key: prompt[key] + own[key] for key in prompt}
