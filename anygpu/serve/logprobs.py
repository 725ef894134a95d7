"""The engine's token log-probabilities (``CompletionOutput.logprobs``: per token, ``{id: Logprob}`` of the
sampled token and the k most likely) in OpenAI's two shapes.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``
- completions (the legacy API): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}``, offsets counted in characters of the returned text from ``offset`` on.

Values are the model's own distribution (vLLM's default: before penalties, temperature and top-k/top-p).
"""

from __future__ import annotations


def _top(entry: dict, k: int) -> list:
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)[:k]


def _item(text: str | None, logprob: float) -> dict:
    text = text or ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(token_ids: list[int], entries: list[dict], k: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        content.append({**_item(chosen.decoded_token, chosen.logprob),
                        "top_logprobs": [_item(lp.decoded_token, lp.logprob) for lp in _top(entry, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict], k: int, offset: int = 0) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        tokens.append(chosen.decoded_token or "")
        values.append(chosen.logprob)
        tops.append({lp.decoded_token or "": lp.logprob for lp in _top(entry, k)})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
