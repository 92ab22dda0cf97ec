"""Runs an LLMEngine on its own thread and feeds its outputs to asyncio consumers.

Workers are asyncio Ray actors: their event loop must stay free to answer Ray calls while the
engine computes. So the engine lives on one dedicated thread; every call that changes engine
state is queued to that thread (the engine is not thread-safe), and each step's outputs are
handed to per-request asyncio queues on the actor's loop. `write_kv` is the one exception: the
KV receiver calls it from its own threads, which the engine allows for reserved blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine imports torch; this module stays importable without it
    from pdserve.engine.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)

# Put on a request's queue when it ends without a final output (aborted, expired, engine died).
END_OF_STREAM = object()


class EngineLoop:
    """Owns the engine thread. `call()` runs a function on it; outputs go to `open_stream()`s."""

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, asyncio.Queue] = {}
        self._stopped = threading.Event()
        self.step_listeners: list[Callable[[list[RequestOutput], float], None]] = []
        # Why the latest engine step failed ("RuntimeError: ..."); "" once one succeeds again.
        # Workers report it in their stats and on the streams the failure ended.
        self.failure = ""
        # The engine thread's heartbeat: while it has work, when it last made progress (began
        # working, or ended a step). Read by the actor's event loop (`step_age`).
        self._working = False
        self._progressed_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs fn() on the engine thread between two steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    async def acall(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """A queue that will receive the request's RequestOutputs (and END_OF_STREAM)."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_nowait(END_OF_STREAM)

    def step_age(self) -> float:
        """Seconds the engine has been in its current step while it has work; 0 when idle. A
        thread stuck in a step shows here even while the actor's event loop answers."""
        return time.monotonic() - self._progressed_at if self._working else 0.0

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # else a step is stuck and may still use the tiers
            self.engine.close()

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            # Block for commands only when there is nothing to compute.
            self._drain_commands(block=not self.engine.has_unfinished())
            if self._stopped.is_set() or not self.engine.has_unfinished():
                self._working = False
                continue
            if not self._working:
                self._progressed_at, self._working = time.monotonic(), True
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step must not hang every waiting client
                log.exception("engine step failed; aborting all requests")
                lines = str(exc).strip().splitlines()
                self.failure = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
                self._abort_everything()
                continue
            self.failure = ""
            elapsed = time.perf_counter() - started
            self._progressed_at = time.monotonic()
            self._working = self.engine.has_unfinished()
            for listener in self.step_listeners:
                listener(outputs, elapsed)
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _drain_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._run_command(fn, future)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # delivered to the caller, never lost
            future.set_exception(exc)

    def _abort_everything(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        self._loop.call_soon_threadsafe(self._end_all_streams)

    def _end_all_streams(self) -> None:
        for request_id in list(self._streams):
            self.close_stream(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put_nowait(output)
            if output.ends_request:  # every choice finished (n > 1 has several)
                self._streams.pop(output.request_id, None)
