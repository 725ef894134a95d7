"""``LLMEngine``: requests in, a step at a time, outputs with new text out.

    engine = LLMEngine("path/to/model.gguf")          # or an HF folder, or None for the default model
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():                      # RequestOutput: delta_text, text, token_ids, finished...
            print(out.delta_text, end="")

A step = ``Scheduler.schedule`` (which sequences compute how many tokens) -> ``ModelRunner.run`` (one forward of
the flat batch, sampling) -> ``Scheduler.update`` (append tokens, finish on EOS / stop ids / length) -> text:
each new token is detokenized incrementally, stop strings are searched in the new text, and the last
``len(longest stop) - 1`` characters are held back from ``delta_text`` until they cannot start a stop string.

**Run-ahead** (GPUs): when every running sequence decodes, none waits, and every one samples from its logits
alone (greedy, or temperature / top-k / top-p / min-p, seeded or not: no penalty, grammar or log-probabilities),
step n + 1 is launched (its decode graph, its input ids copied on the device from step n's tokens, its sampling)
before step n's tokens are read, and the host turns those into outputs while n + 1 runs, so the host's share of a
step hides behind the device's (vLLM's async scheduling).  A sequence that step n finishes computes one token in
n + 1 that nothing reads (an unseeded one draws from the global generator for it, so unseeded draws differ from
stepping one at a time; seeded sequences draw from their own).  Under tensor parallelism only greedy steps run
ahead.  ``ANYGPU_RUN_AHEAD=0`` (or ``engine.run_ahead = False``) steps one at a time.

Bad input (an empty or over-long prompt, bad sampling values, a duplicate request id) raises ValueError from
``add_request`` and changes nothing: the requests already running go on.

No one request can stop the engine (``errors.py``).  A request whose sampling or text handling raises inside a
step finishes alone with ``finish_reason="error"`` and ``error`` set, and the step goes on for the others.  A
forward that raises is retried one sequence at a time: the sequences that fail alone are failed, the others
keep the tokens of their solo runs (this also gets a step that ran out of memory through).  When every
sequence fails alone as well, or the batch held one sequence, or under tensor parallelism (the ranks would
disagree on what was run), the fault is the engine's: ``step`` raises and the engine is dead (``healthy`` turns
False, ``error`` holds the cause).

``tp=N`` shards the model over N ranks (``distributed.py``): this process is rank 0 (it schedules and samples),
N - 1 spawned workers hold the other shards; on CUDA/ROCm one GPU each (from the engine's device on), on the
CPU gloo ranks (for tests).  Scripts that use it need the usual ``if __name__ == "__main__":`` guard of
``multiprocessing``'s spawn.  ``close()`` stops the workers; so do garbage collection and interpreter exit.
The all-reduces use PyTorch's symmetric memory on CUDA where they can, NCCL otherwise; the environment variable
``ANYGPU_TP_ALLREDUCE=auto|nccl|symm_mem`` chooses (``models/parallel.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from dataclasses import dataclass, field

import torch

from .. import backend
from ..models import open_checkpoint
from ..models.parallel import check_all_reduce_mode, check_tp
from ..models.tokenizer import IncrementalDetokenizer
from .block_manager import BlockManager
from .distributed import RankSpec, TPWorkers
from .errors import classify
from .guided import GuideFactory
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus
from .stats import EngineStats

log = logging.getLogger("anygpu.engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Logprob:
    """vLLM's: one token's log-probability under the model, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request, vLLM's shape (``index``, ``text``, ``token_ids``, ``finish_reason``, ...),
    plus what a stream needs: ``delta_text`` and ``delta_token_ids``, new since the previous output."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None  # with SamplingParams.logprobs: the sum over token_ids
    # With SamplingParams.logprobs = k: per token, {id: Logprob} of the sampled token (first) and the k most likely.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step, vLLM's shape: ``outputs[i]`` are its completions (``SamplingParams.n``
    of them; one from ``LLMEngine``, n merged by ``parallel_sampling.ParentRequest``).  ``text``, ``token_ids``, ``finish_reason``, ``stop_reason``, ``delta_text`` and ``delta_token_ids``
    read ``outputs[0]``'s, for code written against the single-completion shape."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput()])
    finished: bool = False
    prompt: str | None = None  # the prompt's text when it was given as text (LLM.generate fills it in)
    prompt_logprobs: list | None = None
    error: str | None = None  # finish_reason "error": what failed (errors.py)
    error_type: str | None = None  # finish_reason "error": "invalid_request" or "internal"
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0

    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)
    stop_reason = property(lambda self: self.outputs[0].stop_reason)
    delta_text = property(lambda self: self.outputs[0].delta_text)
    delta_token_ids = property(lambda self: self.outputs[0].delta_token_ids)


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    stop_reason: str | int | None = None
    error: str | None = None
    error_type: str | None = None
    hold: int = 0  # characters held back from delta_text: len(longest stop string) - 1
    logprobs: list = field(default_factory=list)  # CompletionOutput.logprobs so far (built once per token)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs, built once all are computed


def check_request(prompt, params, vocab_size: int, tokenizer, max_model_len: int) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and the validated params, or a ValueError naming the bad field.  Shared by
    ``LLMEngine.add_request`` and the client of an engine in another process (which must refuse the same things
    synchronously)."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: expected a SamplingParams, got {type(params).__name__}")
    params.validate(vocab_size)
    if params.n != 1:
        raise ValueError(f"n: an engine request runs one completion; n = {params.n} runs through LLM.generate or "
                         f"AsyncLLMEngine.generate, which fan out (parallel_sampling.py)")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this engine has no tokenizer; pass token ids")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids must be in [0, {vocab_size}), got {bad[:3]}")
    else:
        raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt: expected at least one token, got an empty prompt")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate in the context of "
                         f"{max_model_len} tokens (max_model_len)")
    return ids, params


def resolve_dtype(dtype, device: torch.device, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    if dtype not in (None, "auto"):
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    if device.type == "cpu":
        # fp32 on the CPU: the fp32 oracle's tokens.  bf16 would halve the weight bytes, but it flips SmolLM2's
        # first answer token (a 0.082 logit lead) and the answer goes wrong.
        return torch.float32
    return config.dtype if config.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


_new = object.__new__
_FINISHED = SequenceStatus.FINISHED


class LLMEngine:
    def __init__(self, model=None, *, dtype="auto", device=None, quantize: str | None = None, tune: bool = False,
                 block_size: int = 16, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False, progress: bool = True,
                 config=None, tokenizer=None, tp: int = 1):
        """``model``: a GGUF file, an HF folder, or None for the default model.  For benchmarks in real shapes
        without a checkpoint: ``config=ModelConfig(...)`` (random weights; ``tokenizer`` optional).  ``tp``: the
        number of tensor-parallel ranks (GPUs)."""
        self._exit = contextlib.ExitStack()  # first: close() must work whatever __init__ got to
        self._workers: TPWorkers | None = None
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp: expected a positive int (the number of GPUs to shard the model over), got {tp!r}")
        # backend.device(), not current().device: the full description imports Triton to report its version,
        # a large library a CPU engine never runs.
        self.device = torch.device(device) if device is not None else backend.device()
        if tp > 1:
            self.device = _tp_device(self.device, tp)
        if config is None:
            ckpt = open_checkpoint(model)
            config, self.tokenizer, self.model_name = ckpt.config, ckpt.tokenizer, ckpt.name
            self.model_path = ckpt.path
            weights = ckpt.weights(progress=progress)
        else:
            ckpt = None
            self.tokenizer, self.model_name, weights = tokenizer, model or "random", "random"
            self.model_path = None  # random weights: no file
        self.config = config
        check_tp(config, tp)  # before anything is built or spawned
        self.tp = tp
        self.dtype = resolve_dtype(dtype, self.device, config)
        if tp > 1:
            check_all_reduce_mode(self.device, tp, self.dtype)  # ANYGPU_TP_ALLREDUCE, before anything is spawned
        gpu = self.device.type == "cuda"
        max_model_len = min(max_model_len or config.max_position, config.max_position)
        max_num_seqs = max_num_seqs or (256 if gpu else 16)
        max_num_batched_tokens = max_num_batched_tokens or (8192 if gpu else 2048)
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if block_size & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two, got {block_size}")
        self.max_model_len = max_model_len
        runner_args = dict(block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           max_num_batched_tokens=max_num_batched_tokens, num_blocks=num_kv_blocks,
                           kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                           enforce_eager=enforce_eager)
        spec = RankSpec(config, None if self.model_path is None else str(self.model_path), self.dtype, self.device,
                        world_size=tp, quantize=quantize, tune=tune, runner_args=runner_args)
        if tp == 1:
            self.model = spec.build_model(0, weights, progress, checkpoint=ckpt)
            self.runner = spec.build_runner(self.model, self._exit)
        else:
            self._start_tp(spec, weights, progress)
        capacity = self.runner.num_blocks * block_size
        if capacity < max_model_len:
            self.close()  # the workers, if any, would otherwise wait for the engine's garbage collection
            raise ValueError(f"max_model_len: {max_model_len} tokens do not fit the KV cache ({capacity} tokens); "
                             f"lower max_model_len or give the cache more memory")
        self.block_manager = BlockManager(self.runner.num_blocks, block_size)
        eos = tuple(config.eos_token_ids) or (tuple(self.tokenizer.eos_token_ids) if self.tokenizer else ())
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                   eos_token_ids=eos)
        self.requests: dict[str, _Request] = {}
        self._ids_by_seq: dict[int, str] = {}
        self._guides = GuideFactory(self.tokenizer, config.vocab_size, eos)  # guided_json requests only
        self.error: BaseException | None = None  # what made a step raise (see the module docstring)
        # Decode steps launched one ahead (see _launch_ahead): on GPUs, where the device runs a step while
        # the host finishes the one before; the CPU computes as it launches, so there only tests turn it on.
        self.run_ahead = self.device.type == "cuda" and os.environ.get("ANYGPU_RUN_AHEAD", "1") != "0"
        self._ahead = None

    # -- requests --------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids, params = check_request(prompt, params, self.config.vocab_size, self.tokenizer, self.max_model_len)
        seq = Sequence(ids, params)
        if params.guided_json is not None:
            seq.guide = self._guides.new(params.guided_json)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if self.tokenizer else None
        hold = max(map(len, params.stop)) - 1 if params.stop else 0
        self.requests[request_id] = _Request(seq, detok, hold=hold)
        self._ids_by_seq[seq.seq_id] = request_id
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (a client that went away).  Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._ids_by_seq.pop(req.seq.seq_id, None)
            self.scheduler.abort(req.seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- what the server reads (protocol.py) -----------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, self.block_manager.num_blocks,
                           self.block_manager.num_free_blocks)

    @property
    def healthy(self) -> bool:
        """False once a step has raised: the fault was the engine's, not one request's."""
        return self.error is None

    @property
    def eos_token_ids(self) -> frozenset:
        return self.scheduler.eos_token_ids

    # -- stepping --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except Exception as error:
            self.error = error
            raise

    def _step(self) -> list[RequestOutput]:
        flight, self._ahead = self._ahead, None
        if flight is not None and all(s.is_finished for s in flight.batch.seqs):
            flight = None  # a step run ahead for sequences that all finished since: nothing in it is read
        if flight is None:
            batch = self.scheduler.schedule()
            if self.run_ahead and self.runner.can_launch(batch):
                try:
                    flight = self.runner.launch(batch)
                except Exception:
                    if self.tp > 1:
                        raise  # the workers may have run it: the ranks would disagree (as in _run)
                    flight = None  # _run below retries it (one sequence at a time if need be)
        if flight is not None:
            batch = flight.batch
            self._ahead = self._launch_ahead(flight)
            sampled = flight.tokens()
        else:
            sampled = self._run(batch) if batch.seqs else []
        failed = []
        for i, (seq, token) in enumerate(zip(batch.seqs, sampled)):
            if not isinstance(token, Exception) and token is not None and seq.guide is not None:
                token = _advance(seq.guide, token)
            if isinstance(token, Exception):
                self._fail(seq, token)
                failed.append(seq)
                sampled[i] = None  # update() skips finished sequences
        finished = self.scheduler.update(batch, sampled) + failed  # also those schedule() finished
        for seq in batch.seqs:  # a complete grammar ends its request (its last token is kept)
            if seq.guide is not None and seq.guide.done and not seq.is_finished:
                self.scheduler.finish(seq, "stop")
                finished.append(seq)
        outputs: dict[str, RequestOutput] = {}
        ids_by_seq, requests = self._ids_by_seq, self.requests
        for seq, token in zip(batch.seqs, sampled):
            request_id = ids_by_seq.get(seq.seq_id)
            if token is None or request_id is None:
                continue
            req = requests[request_id]
            try:
                self._add_text(req, token)
            except Exception as error:  # this request's text (a detokenizer or stop-string fault): it alone ends
                self._fail(seq, error)
            outputs[request_id] = self._output(request_id, req)
        # Finished without a new token this step (a lone sequence that outgrew the cache) still report.
        for seq in finished:
            request_id = ids_by_seq.get(seq.seq_id)
            if request_id is not None and request_id not in outputs:
                outputs[request_id] = self._output(request_id, requests[request_id])
        for request_id, out in outputs.items():  # finished: by the scheduler, a stop string or an error
            if out.finished:
                ids_by_seq.pop(requests.pop(request_id).seq.seq_id, None)
        return list(outputs.values())

    def _launch_ahead(self, flight):
        """Launch the decode step after ``flight`` before reading ``flight``'s tokens (None when it cannot), so the
        device runs it while the host turns ``flight``'s tokens into outputs: the same sequences one token further,
        as the scheduler would schedule them next when every running sequence decodes and none waits.  A sequence
        that ``flight``'s token finishes (EOS, a stop, its length) computes one token in vain, never read:
        ``Scheduler.update`` skips finished sequences.  Anything else (a request waiting, a prefill, a sequence
        gone, no block for the next token) leaves the choice to the scheduler at the next step."""
        batch, sched = flight.batch, self.scheduler
        if sched.num_waiting or len(batch.seqs) != sched.num_running:
            return None
        if any(s.is_finished for s in batch.seqs):
            return None
        bm = self.block_manager
        for seq in batch.seqs:  # the slot of the token after flight's (blocks it would take next step anyway)
            if not bm.ensure_slots(seq, 2):
                return None
        nxt = ScheduledBatch(list(batch.seqs), [1] * len(batch.seqs), needs_logits=[True] * len(batch.seqs))
        try:
            return self.runner.launch(nxt, after=flight)
        except Exception as error:  # the step then runs scheduled, as any other
            if self.tp > 1:
                raise  # the workers may have run it: the ranks would disagree (as in _run)
            log.warning("running a decode step ahead failed (%r); it runs scheduled instead", error)
            return None

    def _run(self, batch: ScheduledBatch) -> list:
        """The runner's step, retried one sequence at a time if it raises (see the module docstring)."""
        try:
            return self.runner.run(batch)
        except Exception as error:
            if self.tp > 1 or len(batch.seqs) < 2:
                raise
            results = [self._run_alone(batch, i) for i in range(len(batch.seqs))]
            if all(isinstance(r, Exception) for r in results):
                raise error from None  # not one request's fault: the model or the device
            log.warning("a step of %d sequences failed (%r); %d failed alone and end with an error", len(results),
                        error, sum(isinstance(r, Exception) for r in results))
            return results

    def _run_alone(self, batch: ScheduledBatch, i: int):
        alone = ScheduledBatch([batch.seqs[i]], [batch.num_tokens[i]], needs_logits=[batch.needs_logits[i]])
        try:
            return self.runner.run(alone)[0]
        except Exception as error:
            return error

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End seq's request with finish_reason "error" (its KV blocks are freed now); the others go on."""
        request_id = self._ids_by_seq.get(seq.seq_id)
        req = self.requests.get(request_id) if request_id is not None else None
        if req is None:
            return
        req.error_type, req.error = classify(error)
        log.warning("request %s failed: %s", request_id, req.error)
        self.scheduler.finish(seq, "error")
        seq.finish_reason = "error"  # also when it had just finished otherwise

    def _add_text(self, req: _Request, token: int) -> None:
        seq = req.seq
        stopped = seq.finish_reason == "stop"
        if stopped and token in seq.params.stop_token_ids:
            req.stop_reason = token
        detok = req.detok
        if detok is None:
            return
        delta = detok.add(token)
        # EOS and stop ids end the text without appearing in it (vLLM); other special tokens follow
        # skip_special_tokens.
        if stopped and (token in self.scheduler.eos_token_ids or token in seq.params.stop_token_ids):
            delta = ""
        if seq.status is _FINISHED:
            delta += detok.flush()  # bytes held back for an incomplete character: nothing more will come
            if delta:
                req.text += delta
            return
        if not delta:
            return
        before = len(req.text)
        text = req.text = req.text + delta
        stops = seq.params.stop
        if stops:
            # Only the new text and the req.hold characters before it can hold a stop string that was not
            # there at the previous token: each search covers that tail, whatever the length of the text.
            start = max(0, before - req.hold)
            index, stop = -1, None
            for s in stops:
                i = text.find(s, start)
                if i >= 0 and (index < 0 or (i, s) < (index, stop)):
                    index, stop = i, s
            if index >= 0:
                req.text = text[: index + len(stop) if seq.params.include_stop_str_in_output else index]
                req.stop_reason = stop
                self.scheduler.finish(seq, "stop")

    def _output(self, request_id: str, req: _Request) -> RequestOutput:
        """The request's RequestOutput after this step.  Every running request gets one every step, so it is built
        without the dataclasses' ``__init__``: each instance's ``__dict__`` is assigned whole, with the fields in
        declaration order, which gives the object ``__init__`` would (tests/test_engine_outputs.py compares
        them field for field)."""
        seq = req.seq
        finished = seq.status is _FINISHED
        # Hold back what could still turn out to be the start of a stop string.
        text = req.text
        visible = max(req.emitted_chars, len(text) - (0 if finished else req.hold))
        tokens = seq.output_token_ids
        params = seq.params
        cumulative, logprobs = self._logprobs(req) if params.logprobs is not None else (None, None)
        completion = _new(CompletionOutput)
        completion.__dict__ = {
            "index": 0, "text": text[:visible], "token_ids": tokens[:], "cumulative_logprob": cumulative,
            "logprobs": logprobs, "finish_reason": seq.finish_reason, "stop_reason": req.stop_reason,
            "delta_text": text[req.emitted_chars: visible], "delta_token_ids": tokens[req.emitted_tokens:]}
        out = _new(RequestOutput)
        out.__dict__ = {
            "request_id": request_id, "prompt_token_ids": seq.prompt_token_ids, "outputs": [completion],
            "finished": finished, "prompt": None,
            "prompt_logprobs": self._prompt_logprobs(req) if params.prompt_logprobs is not None else None,
            "error": req.error, "error_type": req.error_type, "arrival_time": seq.arrival_time,
            "first_token_time": seq.first_token_time, "finish_time": seq.finish_time,
            "num_cached_tokens": seq.num_cached_tokens}
        req.emitted_chars, req.emitted_tokens = visible, len(tokens)
        return out

    def _entry(self, token: int, logprob: float, rank: int, top: list) -> dict[int, Logprob]:
        """vLLM's ``{id: Logprob}`` for one position: the token first, then the most likely ones.  A token's text
        is ``tokenizer.decode([id], skip_special_tokens=False)``, kept per id by the window decoder."""
        tok = self.tokenizer
        text = tok.window_decoder(False).token_text if tok is not None else (lambda t: None)
        entry = {token: Logprob(logprob, rank, text(token))}
        for r, (tid, lp) in enumerate(top, 1):
            if tid not in entry:
                entry[tid] = Logprob(lp, r, text(tid))
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

    def _start_tp(self, spec: RankSpec, weights, progress: bool) -> None:
        """Rank 0's side of the start-up (see distributed.py): the workers build while this process does."""
        self._workers = workers = TPWorkers(spec)
        # Garbage collection and interpreter exit stop the workers too (the callback holds no engine reference).
        self._finalizer = weakref.finalize(self, workers.close)
        try:
            self.model = spec.build_model(0, weights, progress)
            workers.wait_for("built")
            workers.init_process_group()
            self.runner = workers.runner = spec.build_runner(self.model, self._exit, workers=workers)
            workers.wait_for("ready")
        except BaseException as e:  # KeyboardInterrupt too: never leave the workers behind
            errors = workers.worker_errors()
            workers.close()
            if errors:
                raise RuntimeError(f"tp: starting the {spec.world_size} ranks failed:\n{errors}") from e
            raise

    def close(self) -> None:
        """Release the engine: tuning routes, and under tensor parallelism the workers and the process group."""
        self._exit.close()
        if self._workers is not None:
            self._workers.close()


def _advance(guide, token: int):
    """token, after moving the sequence's grammar on it; the exception instead if the grammar refuses it."""
    try:
        guide.advance(token)
    except Exception as error:
        return error
    return token


def _tp_device(device: torch.device, tp: int) -> torch.device:
    """Rank 0's device for ``tp`` ranks: the CPU (gloo), or an indexed CUDA/ROCm device with tp - 1 after it."""
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"tp: tensor parallelism runs on CUDA/ROCm GPUs or the CPU, not on {device}")
    first = device.index if device.index is not None else torch.cuda.current_device()
    available = torch.cuda.device_count() - first
    if tp > available:
        raise ValueError(f"tp: {tp} ranks need {tp} GPUs from {device} on, but {available} are visible; reduce tp")
    return torch.device("cuda", first)
