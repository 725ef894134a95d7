"""``EngineClient``: an ``LLMEngine`` in its own process, driven through the same step-at-a-time interface
(``protocol.StepEngine``: ``add_request`` / ``abort`` / ``step`` / ``has_unfinished``, and the model's facts,
``stats()`` and ``healthy``), so ``AsyncLLMEngine(EngineClient(factory))`` serves from it unchanged.

Why a process: in one process the HTTP event loop and the engine share the GIL.  At 256 concurrent streams the
loop turns ~8k tokens a second into SSE chunks, and every millisecond it holds the GIL when a step ends is a
millisecond the GPU waits for its next launch: on the H200 the server reached only ~70 % of the offline engine's
throughput that way.  Here the engine loop runs on its own interpreter and never waits for the web side.

    client = EngineClient(functools.partial(LLMEngine, "model.gguf", dtype="bfloat16"))

``factory`` builds the engine in the child (it must pickle: a top-level function or a partial of one).  The
protocol is plain tuples over a pipe, our own data only (nothing from a checkpoint is unpickled here):

    client -> engine   ("add", request_id, prompt_ids, params) | ("abort", request_id) | ("stop",)
    engine -> client   ("ready", info) once, or ("failed", kind, message)
                       ("step", deltas, stats) after every step and after control messages
                       ("fatal", traceback) when a step fails for the engine (it then exits non-zero)
    delta = (request_id, delta_text, delta_token_ids, finished, finish_reason, stop_reason,
             arrival_time, first_token_time, finish_time, num_cached_tokens, error, error_type,
             cumulative_logprob, new_logprobs, prompt_logprobs)

``prompt_logprobs`` crosses once, with the request's first output (the engine has them complete by then).

Only deltas cross the pipe (a step of 256 sequences is a few tens of KB); the client rebuilds each request's
cumulative text and ids.  Prompts are tokenized and checked in the client with the engine's own rules
(``check_request``), so bad input still fails synchronously in ``add_request``.  Timestamps come from
``time.monotonic``-based clocks, which are system-wide on Linux, so they compare across the two processes.
A request that fails inside a step ends alone (``finish_reason="error"``, ``errors.py``) and the engine process
steps on.  If the engine itself fails, the process reports why (``"fatal"``) and exits with status 1; if it dies
(killed), ``step`` raises either way and ``AsyncLLMEngine`` fails the open streams and marks itself dead.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from dataclasses import dataclass, field

from .errors import classify
from .llm_engine import CompletionOutput, RequestOutput, check_request
from .stats import EngineStats

STARTUP_TIMEOUT_S = 1800  # an 8B checkpoint read from a slow disk, plus warmup and graph capture


@dataclass
class _Live:
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class EngineClient:
    def __init__(self, factory, poll_s: float = 0.01):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: the engine may start tensor-parallel workers of its own, which daemons cannot.
        self._proc = ctx.Process(target=_engine_main, args=(factory, child), name="anygpu-engine-process")
        self._proc.start()
        child.close()
        self._poll_s = poll_s
        self._send_lock = threading.Lock()
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the engine process did not start within {STARTUP_TIMEOUT_S} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.exitcode})") from None
        if message[0] == "failed":
            self.close()
            _, kind, text = message
            raise (ValueError if kind == "ValueError" else RuntimeError)(text)
        info = message[1]
        self.config, self.tokenizer = info["config"], info["tokenizer"]
        self.model_name, self.model_path = info["model_name"], info["model_path"]
        self.max_model_len, self.device, self.dtype = info["max_model_len"], info["device"], info["dtype"]
        self.eos_token_ids = info["eos_token_ids"]
        self._stats = EngineStats(num_blocks=info["num_blocks"], num_free_blocks=info["num_blocks"])
        self._error: BaseException | None = None
        self.requests: dict[str, _Live] = {}
        self._pending: list[RequestOutput] = []

    # -- the LLMEngine interface (protocol.StepEngine) -------------------------------------------------
    def stats(self) -> EngineStats:
        """As the engine process reported it with its last step."""
        return self._stats

    @property
    def healthy(self) -> bool:
        """False once the engine process has failed or died (or was closed)."""
        return self._error is None and self._proc.is_alive()

    def add_request(self, request_id: str, prompt, params=None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids, params = check_request(prompt, params, self.config.vocab_size, self.tokenizer, self.max_model_len)
        self.requests[request_id] = _Live(ids)
        self._send(("add", request_id, ids, params))

    def abort(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def has_unfinished(self) -> bool:
        # Also read what has arrived: after an abort the engine reports its freed blocks although no request
        # is left here to step for.
        self._pending += self._receive(0)
        return bool(self.requests or self._pending)

    def step(self) -> list[RequestOutput]:
        """The outputs of the engine's next step, or [] if none arrives within ``poll_s`` (so the caller can
        take new requests and aborts meanwhile)."""
        outputs, self._pending = self._pending, []
        return outputs + self._receive(0 if outputs else self._poll_s)

    def _receive(self, timeout: float) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        # Wait once, then take everything already there: a caller that fell behind catches up in one call.
        while True:
            try:
                if not self._conn.poll(timeout):
                    break
                message = self._conn.recv()
            except (EOFError, OSError):  # closed pipe, or reset when the process was killed
                self._proc.join(timeout=5)
                self._error = RuntimeError(f"the engine process died (exit code {self._proc.exitcode})")
                raise self._error from None
            if message[0] == "fatal":
                self._proc.join(timeout=5)
                self._error = RuntimeError(f"the engine process failed and exited:\n{message[1]}")
                raise self._error
            _, deltas, stats = message
            self._take_stats(stats)
            for d in deltas:
                out = self._output(*d)
                if out is not None:
                    outputs.append(out)
            timeout = 0
        return outputs

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=10)
        self._conn.close()

    # -- internals -------------------------------------------------------------------------------------
    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _take_stats(self, stats) -> None:
        running, waiting, free = stats
        self._stats = EngineStats(running, waiting, self._stats.num_blocks, free)

    def _output(self, request_id, delta_text, delta_ids, finished, finish_reason, stop_reason, arrival,
                first_token, finish, cached, error, error_type, cumulative_logprob,
                delta_logprobs, prompt_logprobs) -> RequestOutput | None:
        live = self.requests.get(request_id)
        if live is None:  # aborted here before the engine heard of it
            return None
        live.text += delta_text
        live.token_ids.extend(delta_ids)
        if delta_logprobs is not None:
            live.logprobs = live.logprobs if live.logprobs is not None else []
            live.logprobs.extend(delta_logprobs)
        if prompt_logprobs is not None:
            live.prompt_logprobs = prompt_logprobs
        if finished:
            del self.requests[request_id]
        logprobs = list(live.logprobs) if live.logprobs is not None else None
        completion = CompletionOutput(0, live.text, list(live.token_ids), cumulative_logprob, logprobs,
                                      finish_reason=finish_reason,
                                      stop_reason=stop_reason, delta_text=delta_text, delta_token_ids=delta_ids)
        return RequestOutput(request_id, live.prompt_token_ids, [completion], finished=finished, arrival_time=arrival,
                             first_token_time=first_token, finish_time=finish, num_cached_tokens=cached,
                             error=error, error_type=error_type, prompt_logprobs=live.prompt_logprobs)


def _wire(o: RequestOutput) -> tuple:
    """What crosses the pipe for one output: its deltas (the client keeps the cumulative text and ids)."""
    c = o.outputs[0]
    new_logprobs = None if c.logprobs is None else c.logprobs[len(c.token_ids) - len(c.delta_token_ids):]
    first = len(c.token_ids) == len(c.delta_token_ids)  # this request's first output (or one with no tokens)
    return (o.request_id, c.delta_text, c.delta_token_ids, o.finished, c.finish_reason, c.stop_reason,
            o.arrival_time, o.first_token_time, o.finish_time, o.num_cached_tokens, o.error, o.error_type,
            c.cumulative_logprob, new_logprobs, o.prompt_logprobs if first else None)


def _stats(engine) -> tuple:
    """What changes from step to step (the number of blocks does not: it crosses once, at start-up)."""
    s = engine.stats()
    return s.num_running, s.num_waiting, s.num_free_blocks


def _handle(engine, conn, message) -> bool:
    """Apply one control message; False for "stop"."""
    if message[0] == "stop":
        return False
    if message[0] == "abort":
        engine.abort(message[1])
        return True
    _, request_id, ids, params = message
    try:
        engine.add_request(request_id, ids, params)
    except Exception as error:  # checked by the client already: only a race or a fault could get here
        error_type, text = classify(error)
        conn.send(("step", [(request_id, "", [], True, "error", None, 0.0, None, None, 0, text, error_type,
                             None, None, None)], _stats(engine)))
    return True


def _engine_main(factory, conn) -> None:
    """The engine process: build the engine, then step while there is work and block on the pipe when idle."""
    import traceback

    try:
        engine = factory()
    except BaseException as error:  # report it: the parent would otherwise only see an exit code
        kind = "ValueError" if isinstance(error, (ValueError, FileNotFoundError)) else "RuntimeError"
        text = str(error) if kind == "ValueError" else traceback.format_exc()
        conn.send(("failed", kind, text))
        return
    try:
        conn.send(("ready", {
            "config": engine.config, "tokenizer": engine.tokenizer, "model_name": engine.model_name,
            "model_path": engine.model_path, "max_model_len": engine.max_model_len, "device": engine.device,
            "dtype": engine.dtype, "eos_token_ids": engine.eos_token_ids, "num_blocks": engine.stats().num_blocks}))
        dirty = False  # control messages changed the state since the last report
        while True:
            while conn.poll(0):
                if not _handle(engine, conn, conn.recv()):
                    return
                dirty = True
            if not engine.has_unfinished():
                if dirty:  # e.g. an abort freed blocks: say so now, not at the next step
                    conn.send(("step", [], _stats(engine)))
                    dirty = False
                if not _handle(engine, conn, conn.recv()):  # idle: block until there is something to do
                    return
                dirty = True
                continue
            try:
                outputs = engine.step()
            except Exception:  # the engine's own failure (one request's ends inside step): say why, exit 1
                with contextlib.suppress(OSError):
                    conn.send(("fatal", traceback.format_exc()))
                raise
            dirty = False
            conn.send(("step", [_wire(o) for o in outputs], _stats(engine)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the parent went away or is stopping us
    finally:
        engine.close()
