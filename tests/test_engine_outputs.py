"""``LLMEngine``'s per-step outputs are what they were before the host-time work on ``_output``, ``_add_text`` and
``_entry`` (docs/perf/2026-12-02-engine-host-time.md): ``ReferenceEngine`` below keeps those three methods (and
the log-probability helpers) as they were, as the spec, and every step's ``RequestOutput`` of the engine is
compared with the reference's, field for field (the times aside), on random models and random sampling with
stop strings cut out of the generated text (so they fall across tokens), ``include_stop_str_in_output`` both
ways, stop token ids, log-probabilities and prompt log-probabilities, for the synthetic words and SmolLM2's
byte-level BPE.  Also: the outputs built without ``__init__`` are the objects ``__init__`` builds, streamed
deltas add up to the final text and ids, and a log-probability's token text is the library's decode."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
import torch

from anygpu.engine import LLMEngine, SamplingParams
from anygpu.engine.llm_engine import CompletionOutput, Logprob, RequestOutput, _Request
from anygpu.models import ModelConfig
from anygpu.models.tokenizer import Tokenizer

from ._models_fixtures import smollm  # noqa: F401 - fixture
from ._models_fixtures import smollm_path  # noqa: F401 - fixture

CONFIG = ModelConfig(architecture="llama", vocab_size=1024, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position=512, tie_word_embeddings=False, attention_bias=False,
                     sliding_window=None, bos_token_id=1, eos_token_ids=(2,), dtype=None)
TIMES = ("arrival_time", "first_token_time", "finish_time")


class ReferenceEngine(LLMEngine):
    """The engine with its text and output methods as they were (the spec)."""

    def _add_text(self, req: _Request, token: int) -> None:
        seq, params = req.seq, req.seq.params
        if seq.finish_reason == "stop" and token in params.stop_token_ids:
            req.stop_reason = token
        if req.detok is None:
            return
        before = len(req.text)
        delta = req.detok.add(token)
        # EOS and stop ids end the text without appearing in it (vLLM); other special tokens follow
        # skip_special_tokens.
        if seq.finish_reason == "stop" and (token in self.scheduler.eos_token_ids or token in params.stop_token_ids):
            delta = ""
        finished = seq.is_finished
        if finished:
            delta += req.detok.flush()  # bytes held back for an incomplete character: nothing more will come
        req.text += delta
        if params.stop and not finished:
            # Only the new text and the req.hold characters before it can hold a stop string that was not
            # there at the previous token: each search covers that tail, whatever the length of the text.
            start = max(0, before - req.hold)
            hits = [(req.text.find(s, start), s) for s in params.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                req.text = req.text[: index + len(stop) if params.include_stop_str_in_output else index]
                req.stop_reason = stop
                self.scheduler.finish(seq, "stop")

    def _output(self, request_id: str, req: _Request) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished
        # Hold back what could still turn out to be the start of a stop string.
        text = req.text
        visible = max(req.emitted_chars, len(text) - (0 if finished else req.hold))
        tokens = seq.output_token_ids
        completion = CompletionOutput(0, text[:visible], tokens[:], *self._logprobs(req),
                                      finish_reason=seq.finish_reason, stop_reason=req.stop_reason,
                                      delta_text=text[req.emitted_chars: visible],
                                      delta_token_ids=tokens[req.emitted_tokens:])
        out = RequestOutput(request_id, seq.prompt_token_ids, [completion], finished=finished,
                            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
                            finish_time=seq.finish_time,
                            num_cached_tokens=seq.num_cached_tokens, error=req.error, error_type=req.error_type,
                            prompt_logprobs=self._prompt_logprobs(req))
        req.emitted_chars, req.emitted_tokens = visible, len(tokens)
        return out

    def _entry(self, token: int, logprob: float, rank: int, top: list) -> dict[int, Logprob]:
        """vLLM's ``{id: Logprob}`` for one position: the token first, then the most likely ones."""
        tok = self.tokenizer
        text = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else (lambda t: None)
        entry = {token: Logprob(logprob, rank, text(token))}
        for r, (tid, lp) in enumerate(top, 1):
            entry.setdefault(tid, Logprob(lp, r, text(tid)))
        return entry

    def _prompt_logprobs(self, req: _Request) -> list | None:
        """vLLM's ``RequestOutput.prompt_logprobs`` (None first: the first token has no context) once the
        runner has computed every prompt position, else None."""
        seq = req.seq
        if req.prompt_logprobs is None and seq.params.prompt_logprobs is not None and not seq.needs_prompt_logprobs:
            ids = seq.prompt_token_ids
            req.prompt_logprobs = [None] + [self._entry(ids[j + 1], *entry)
                                            for j, entry in enumerate(seq.prompt_logprobs)]
        return req.prompt_logprobs

    def _logprobs(self, req: _Request) -> tuple[float | None, list | None]:
        """(cumulative_logprob, logprobs) for the output, the sampler's new entries converted once each."""
        seq = req.seq
        if seq.params.logprobs is None:
            return None, None
        for pos in range(len(req.logprobs), min(len(seq.output_logprobs), len(seq.output_token_ids))):
            token, (logprob, rank, top) = seq.output_token_ids[pos], seq.output_logprobs[pos]
            req.logprobs.append(self._entry(token, logprob, rank, top))
            req.cumulative_logprob += logprob
        return req.cumulative_logprob, list(req.logprobs)


def make(cls, tokenizer, vocab_size: int) -> LLMEngine:
    torch.manual_seed(0)
    return cls("tiny", config=dataclasses.replace(CONFIG, vocab_size=vocab_size), tokenizer=tokenizer,
               device="cpu", max_num_seqs=6, max_num_batched_tokens=64, max_model_len=200, progress=False)


def plain(out: RequestOutput) -> dict:
    """The output's fields, the completions' and the Logprobs' too, the times left out (two engines differ)."""
    fields = {k: v for k, v in vars(out).items() if k not in TIMES}
    fields["outputs"] = [vars(c) for c in out.outputs]
    return fields


def run(engine: LLMEngine, requests: list) -> list[list]:
    """Every step's outputs; requests arrive two per step."""
    steps, pending = [], list(requests)
    while pending or engine.has_unfinished():
        for request_id, prompt, params in pending[:2]:
            engine.add_request(request_id, prompt, dataclasses.replace(params))
        del pending[:2]
        steps.append(engine.step())
    return steps


def requests(rng: random.Random, texts: list[str], vocab_size: int, count: int) -> list:
    """Random sampling; stop strings cut from generated texts at random places (most cross a token boundary)."""
    out = []
    for i in range(count):
        stops = []
        for _ in range(rng.randint(0, 3) if texts else 0):
            text = rng.choice(texts)
            if len(text) > 2:
                start = rng.randrange(len(text) - 1)
                stops.append(text[start:start + rng.randint(1, 12)])
        if rng.random() < 0.2:
            stops.append("never in the text \u2603")
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.8, 1.5]),
                                seed=rng.randrange(1 << 30), stop=stops,
                                include_stop_str_in_output=rng.random() < 0.5,
                                stop_token_ids=[rng.randrange(100, vocab_size)] if rng.random() < 0.3 else [],
                                logprobs=rng.choice([None, None, 0, 2]),
                                prompt_logprobs=rng.choice([None, None, None, 1]),
                                skip_special_tokens=rng.random() < 0.7, ignore_eos=rng.random() < 0.5)
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        out.append((f"r{i}", prompt, params))
    return out


def same_as_reference(tokenizer, vocab_size: int, seed: int) -> int:
    rng = random.Random(seed)
    first = requests(rng, [], vocab_size, 12)
    texts = [o.text for step in run(make(LLMEngine, tokenizer, vocab_size), first) for o in step if o.finished]
    batch = requests(rng, texts, vocab_size, 24)
    got = run(make(LLMEngine, tokenizer, vocab_size), batch)
    want = run(make(ReferenceEngine, tokenizer, vocab_size), batch)
    assert len(got) == len(want)
    stopped = 0
    for step, (a, b) in enumerate(zip(got, want)):
        assert [plain(o) for o in a] == [plain(o) for o in b], f"step {step}"
        for o in a:
            assert type(o) is RequestOutput and all(type(c) is CompletionOutput for c in o.outputs)
            stopped += isinstance(o.outputs[0].stop_reason, str)
    return stopped


def test_outputs_equal_the_reference_synthetic():
    stopped = sum(same_as_reference(Tokenizer.synthetic(CONFIG.vocab_size, 2), CONFIG.vocab_size, seed)
                  for seed in range(3))
    assert stopped >= 5  # the stop strings did stop requests


def test_outputs_equal_the_reference_byte_level(smollm):  # noqa: F811
    tokenizer = smollm.tokenizer
    stopped = sum(same_as_reference(tokenizer, tokenizer.vocab_size, seed) for seed in range(3))
    assert stopped >= 2


def test_outputs_are_what_init_builds():
    engine = make(LLMEngine, Tokenizer.synthetic(CONFIG.vocab_size, 2), CONFIG.vocab_size)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=1, stop=["zz"]))
    outs = [o for _ in range(4) for o in engine.step()]
    assert outs and outs[-1].finished
    for out in outs:
        for obj, cls in ((out, RequestOutput), (out.outputs[0], CompletionOutput)):
            built = cls(**vars(obj))
            # Every field, in declaration order: a field added to the class must be added to _output too.
            assert list(vars(obj)) == [f.name for f in dataclasses.fields(cls)] == list(vars(built))
            assert built == obj and repr(built) == repr(obj)
        copy = pickle.loads(pickle.dumps(out))
        assert copy == out and list(vars(copy)) == list(vars(out))
        assert dataclasses.replace(out.outputs[0], index=1).index == 1
        out.outputs[0].delta_text = "changed"  # consumers set fields (async_engine merges deltas)
        assert out.delta_text == "changed"


@pytest.mark.parametrize("include", [False, True])
def test_stream_deltas_add_up_and_stop_strings_cut(include):
    tokenizer = Tokenizer.synthetic(CONFIG.vocab_size, 2)
    engine = make(LLMEngine, tokenizer, CONFIG.vocab_size)
    engine.add_request("free", [9, 10, 11], SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True))
    outs = [o for _ in range(40) for o in engine.step()]
    text = outs[-1].text
    words = text.split(" ")
    stop = words[5][-2:] + " " + words[6][:2]  # across two tokens
    engine.add_request("stop", [9, 10, 11], SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True,
                                                           stop=[stop], include_stop_str_in_output=include))
    outs = [o for _ in range(40) for o in engine.step()]
    index = text.index(stop)
    final = outs[-1]
    assert final.finished and final.stop_reason == stop and final.finish_reason == "stop"
    assert final.text == text[:index + len(stop) if include else index]
    assert "".join(o.delta_text for o in outs) == final.text
    assert sum((o.delta_token_ids for o in outs), []) == final.token_ids
    for o in outs[:-1]:  # nothing of the stop string shows before it is known not to be one
        assert stop[:1] not in o.text[index:]


def test_logprob_texts_are_the_library_decode(smollm):  # noqa: F811
    tokenizer = smollm.tokenizer
    engine = make(LLMEngine, tokenizer, tokenizer.vocab_size)
    special = sorted(tokenizer.backend.get_added_tokens_decoder())[:3]
    prompt = special + tokenizer.encode("Hi \u00e9\U0001f600 there", add_special_tokens=False)
    engine.add_request("a", prompt, SamplingParams(max_tokens=20, temperature=1.5, seed=1, logprobs=5,
                                                    prompt_logprobs=5, ignore_eos=True))
    outs = [o for _ in range(30) for o in engine.step()]
    final = outs[-1]
    entries = [e for e in final.prompt_logprobs[1:]] + final.outputs[0].logprobs
    assert len(entries) == len(prompt) - 1 + 20
    seen = 0
    for entry in entries:
        for tid, lp in entry.items():
            assert isinstance(lp, Logprob)
            assert lp.decoded_token == tokenizer.decode([tid], skip_special_tokens=False)
            seen += 1
    assert seen > 100
    # Ids the window decoder's table does not hold go to the library as before.
    window = tokenizer.window_decoder(False)
    assert window.token_text(tokenizer.vocab_size + 5) == tokenizer.decode([tokenizer.vocab_size + 5], skip_special_tokens=False)
