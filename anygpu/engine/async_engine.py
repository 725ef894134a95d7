"""``AsyncLLMEngine``: the engine behind a server.  One background thread steps the engine while there is work;
each request is an async iterator of ``RequestOutput``s.

    engine = AsyncLLMEngine(LLMEngine(...))
    async for out in engine.generate("req-1", prompt, params):
        send(out.outputs[0].delta_text)

Why a thread: a step is a blocking model call (tens of ms on a GPU, more on the CPU); on the event loop it
would stall every other connection.  The thread owns the ``LLMEngine`` (it is not thread-safe): requests and
aborts reach it through a lock-protected inbox, outputs go back with ``loop.call_soon_threadsafe``.
Leaving the ``async for`` early (a client that disconnects, a cancelled task) aborts the request, and its KV
blocks are freed by the next step.  A request the engine rejects (bad prompt or sampling values) raises
ValueError from the iterator, and the engine goes on serving the others.  A request that fails inside a step
(``errors.py``) raises ``RequestInvalid`` (a ValueError) or ``RequestFailed`` (a RuntimeError) from its iterator;
the others go on.

``SamplingParams.n`` > 1 fans out into n child requests (``parallel_sampling.py``) whose outputs are merged:
each item then has n ``outputs``, with the deltas of each since the previous item.  A child that fails fails
the request (its iterator raises) and aborts the other children.

When the engine itself fails (``step`` raises: see ``LLMEngine``; or the engine process died), every open and
every later request raises ``EngineDead``, ``healthy`` turns False and stays so, ``error`` holds the cause, and
``wait_dead()`` returns it: a server awaits that to exit (or restart) rather than answer 503 forever.

The engine may be an ``LLMEngine`` in this process (it then shares the GIL with the event loop) or an
``EngineClient`` (``engine_process.py``), the same interface over a pipe to an engine in its own process,
which is what ``anygpu serve`` uses: any ``protocol.StepEngine``.  This class is the server's
``protocol.EngineProtocol``: the model's facts and ``stats()`` are the engine's, read through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator

from .errors import EngineDead, RequestFailed, as_exception
from .llm_engine import RequestOutput
from .parallel_sampling import ParentRequest, child_id, child_params
from .protocol import StepEngine
from .sampling_params import SamplingParams
from .stats import EngineStats

log = logging.getLogger("anygpu.engine")


class AsyncLLMEngine:
    # The model the engine runs (protocol.EngineInfo), read through: an EngineClient's are copies made at start-up.
    tokenizer = property(lambda self: self.engine.tokenizer)
    config = property(lambda self: self.engine.config)
    model_name = property(lambda self: self.engine.model_name)
    model_path = property(lambda self: self.engine.model_path)
    max_model_len = property(lambda self: self.engine.max_model_len)
    dtype = property(lambda self: self.engine.dtype)
    device = property(lambda self: self.engine.device)
    eos_token_ids = property(lambda self: self.engine.eos_token_ids)

    def __init__(self, engine: StepEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple] = []  # ("add", id, prompt, params, queue, loop) | ("abort", id)
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._closed: EngineDead | None = None  # set (under _lock) when the thread takes no more messages
        self._dead_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.dead = threading.Event()  # set when the engine has failed (not on shutdown)
        self._thread = threading.Thread(target=self._loop, name="anygpu-engine", daemon=True)
        self._thread.start()

    def generate(self, request_id: str, prompt, params: SamplingParams | None = None
                 ) -> AsyncIterator[RequestOutput]:
        if isinstance(params, SamplingParams) and params.n > 1:
            return self._generate_n(request_id, prompt, params)
        return self._generate_one(request_id, prompt, params)

    async def _generate_n(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        children = child_params(params)
        parent = ParentRequest(request_id, len(children))
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, child: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in child:
                    queue.put_nowait((index, out))
            except Exception as error:  # the child has ended (aborted if it still ran): the request fails
                queue.put_nowait((index, error))

        def start(i: int) -> asyncio.Future:
            return asyncio.ensure_future(pump(i, self._generate_one(child_id(request_id, i), prompt, children[i])))

        tasks = [start(0)]  # the others once child 0's prompt is in the prefix cache (parallel_sampling.py)
        try:
            while not parent.finished:
                items = [await queue.get()]
                while not queue.empty():  # what piled up goes out as one item, as for one completion
                    items.append(queue.get_nowait())
                for index, item in items:
                    if isinstance(item, BaseException):
                        raise item
                    parent.add(index, item)
                if len(tasks) == 1 and parent.rest_may_start:
                    tasks += [start(i) for i in range(1, len(children))]
                if params.prompt_logprobs is not None and parent.latest[0] is None:
                    continue  # the prompt's log-probabilities come with child 0: the first item carries them
                yield parent.output()
        finally:
            for task in tasks:  # cancelling a child's iteration aborts that child in the engine
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_one(self, request_id: str, prompt, params: SamplingParams | None
                            ) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        self._send(("add", request_id, prompt, params, queue, asyncio.get_running_loop()))
        finished = False
        try:
            while True:
                item = await queue.get()
                # Outputs that piled up while this consumer was busy (a loaded server) go out as one:
                # fewer, larger chunks instead of falling further behind.
                while not isinstance(item, BaseException) and not queue.empty():
                    item = _merge(item, queue.get_nowait())
                if isinstance(item, BaseException):
                    finished = True  # the engine has dropped it already
                    raise item
                finished = item.finished
                if item.outputs[0].finish_reason == "error":
                    raise as_exception(request_id, item.error_type, item.error)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        """The engine's, read from the server's thread while the engine thread steps (``/metrics`` at scrape
        time)."""
        return self.engine.stats()

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    @property
    def healthy(self) -> bool:
        """False once a step has failed or the engine thread has ended."""
        return self._error is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine, or None while it runs (or after a plain shutdown)."""
        return self._error

    async def wait_dead(self) -> BaseException:
        """Return the error that stopped the engine, once it has (at once if it already has).  Cancel it to stop
        waiting.  A plain ``shutdown`` is not a death: it does not return then."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._error is None:
                self._dead_waiters.append((loop, future))
        if self._error is not None:
            return self._error
        return await future

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- the engine thread -----------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._lock:
            closed = self._closed
            if closed is None:
                self._inbox.append(message)
        if closed is None:
            self._wake.set()
        elif message[0] == "add":  # called on the request's own event loop: no thread hop needed
            message[4].put_nowait(EngineDead(str(closed)))

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items) -> None:
        """Hand outputs to their streams: one wake-up per event loop per step, not one per request (a step of
        256 sequences would otherwise write 256 times to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                queue, loop = stream
                by_loop.setdefault(loop, []).append((request_id, queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                for request_id, _, _ in batch:
                    self._streams.pop(request_id, None)
                    self.engine.abort(request_id)

    def _drain_inbox(self) -> None:
        with self._lock:
            messages, self._inbox = self._inbox, []
        for message in messages:
            if message[0] == "abort":
                self._streams.pop(message[1], None)
                self.engine.abort(message[1])
                continue
            _, request_id, prompt, params, queue, loop = message
            self._streams[request_id] = (queue, loop)
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as error:  # refused (a ValueError naming the field) or failed: this request only
                self._deliver(request_id, error if isinstance(error, ValueError)
                              else RequestFailed(f"{type(error).__name__}: {error}"))
                self._streams.pop(request_id, None)

    def _loop(self) -> None:
        while not self._stopped:
            try:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
            except BaseException as error:  # not one request's fault (see LLMEngine): the device failed, a
                # bug, the engine process died.  Fail every open stream, loudly.
                log.exception("engine step failed; the engine is stopped (health checks now fail)")
                self._close(EngineDead(f"engine step failed: {error!r}"), error)
                return
            self._deliver_all([(out.request_id, out) for out in outputs])
            for out in outputs:
                if out.finished:
                    self._streams.pop(out.request_id, None)
        self._close(EngineDead("the engine was shut down"), None)

    def _close(self, closed: EngineDead, error: BaseException | None) -> None:
        """Take no more messages; fail the open streams and those still in the inbox with ``closed``; wake the
        ``wait_dead`` waiters when ``error`` (a death, not a shutdown)."""
        with self._lock:
            self._closed, self._error = closed, error
            messages, self._inbox = self._inbox, []
            waiters, self._dead_waiters = self._dead_waiters, []
        for message in messages:
            if message[0] == "add":
                self._streams[message[1]] = (message[4], message[5])
        failed = list(self._streams)
        self._deliver_all([(request_id, EngineDead(str(closed))) for request_id in failed])  # one each: raised
        # in several tasks, a shared exception would collect all their tracebacks
        for request_id in failed:
            with contextlib.suppress(Exception):  # the engine may be gone
                self.engine.abort(request_id)
        self._streams.clear()
        if error is not None:
            self.dead.set()
            for loop, future in waiters:
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    loop.call_soon_threadsafe(_resolve, future, error)


def _merge(older: RequestOutput, newer):
    """``newer`` with the deltas of both (outputs carry cumulative text and ids, and per-step deltas)."""
    if isinstance(newer, BaseException):
        return newer
    for old, new in zip(older.outputs, newer.outputs):
        new.delta_text = old.delta_text + new.delta_text
        new.delta_token_ids = old.delta_token_ids + new.delta_token_ids
    return newer


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _put_all(batch) -> None:
    for _, queue, item in batch:
        queue.put_nowait(item)
