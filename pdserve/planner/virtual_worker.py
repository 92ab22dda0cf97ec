"""VirtualWorker: one simulated worker on the planner's virtual clock.

It plays the part of a worker actor's engine thread (pdserve/worker/engine_loop.py): calls
that change the engine's state (add, reserve, commit, release) run between steps, so one that
arrives during a step waits for its end; a step's outputs are delivered when the step ends,
its modelled duration after it started. It keeps the counters a worker reports to the router
(`WorkerStats`: prompt tokens and seconds of steps that computed prompts, decode steps and
their seconds and tokens, KV bytes sent) and how long the GPU was busy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pdserve.core.messages import ENGINE_COUNT_FIELDS, WorkerStats
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.planner.deployment import StepMeter
from pdserve.planner.events import EventLoop

# (worker, outputs of one step) -> None
OutputSink = Callable[["VirtualWorker", list[RequestOutput]], None]


class VirtualWorker:
    def __init__(
        self,
        worker_id: str,
        role: str,
        engine: LLMEngine,
        meter: StepMeter,
        loop: EventLoop,
        on_outputs: OutputSink,
    ) -> None:
        self.worker_id = worker_id
        self.role = role
        self.engine = engine
        self.busy_seconds = 0.0  # modelled time spent in steps
        self.peak_running = 0  # most sequences running after a step (prefills included)
        self._meter = meter
        self._loop = loop
        self._on_outputs = on_outputs
        self.step_listeners: list[Callable[[], None]] = []  # called as each step ends
        self._stepping = False
        self._kick_pending = False
        self._calls: list[tuple[Callable[[], Any], Callable[[Any], None] | None]] = []
        self._queued_since: dict[str, float] = {}  # request id -> when it was added
        self.queue_waits: dict[str, float] = {}  # request id -> wait before its first step
        self._stats = WorkerStats(
            worker_id=worker_id,
            role=role,
            epoch=1,
            block_size=engine.block_size,
            bytes_per_block=engine.bytes_per_block,
        )

    def set_role(self, role: str) -> None:
        """Serves `role` from now on, with the same engine (pdserve/planner/role_switching.py)."""
        self.role = self._stats.role = role

    def call(self, fn: Callable[[], Any], then: Callable[[Any], None] | None = None) -> None:
        """Runs `fn()` on the engine between steps (now if idle); `then(result)` after it."""
        if self._stepping:
            self._calls.append((fn, then))
            return
        result = fn()
        if then is not None:
            then(result)
        self._kick()

    def track_queue(self, request_id: str) -> None:
        """Call right after adding a request: `queue_waits` gets its wait for a first step."""
        self._queued_since[request_id] = self._loop.now

    def record_transfer(self, num_bytes: int, seconds: float) -> None:
        self._stats.transfer_bytes += num_bytes
        self._stats.transfer_seconds += seconds

    def min_sampling_step_seconds(self) -> float:
        """The timing model's lower bound on a step that samples a token (0: none)."""
        return self._meter.min_sampling_step_seconds()

    def stats(self) -> WorkerStats:
        """What the worker answers a stats poll now."""
        engine_stats = self.engine.stats()
        counts = {name: int(engine_stats[name]) for name in ENGINE_COUNT_FIELDS}
        return dataclasses.replace(self._stats, **counts)

    def _kick(self) -> None:
        """Starts a step once every call of this instant has run (as the engine thread drains
        its queued calls before stepping)."""
        if not self._kick_pending and not self._stepping and self.engine.has_unfinished():
            self._kick_pending = True
            self._loop.after(0.0, self._start_step)

    def _start_step(self) -> None:
        self._kick_pending = False
        if self._stepping or not self.engine.has_unfinished():
            return
        seconds_before, prefill_before = self._meter.seconds, self._meter.prefill_tokens
        outputs = self.engine.step()
        seconds = self._meter.seconds - seconds_before
        running = len(self.engine.scheduler.running)
        if running > self.peak_running:
            self.peak_running = running
        if self._queued_since:
            self._note_scheduled()
        if not outputs and seconds == 0.0:
            return  # nothing could run (no free blocks): a later call frees some and kicks
        computed = self._meter.prefill_tokens - prefill_before
        stats = self._stats
        if computed:
            stats.prefill_tokens += computed
            stats.prefill_seconds += seconds
            stats.prefill_steps += 1
        elif outputs:
            stats.decode_steps += 1
            stats.decode_seconds += seconds
            stats.decode_tokens += sum(len(o.new_token_ids) for o in outputs)
        self.busy_seconds += seconds
        self._stepping = True
        self._loop.after(seconds, lambda: self._end_step(outputs))

    def _end_step(self, outputs: list[RequestOutput]) -> None:
        self._stepping = False
        for listener in self.step_listeners:
            listener()
        if outputs:
            self._on_outputs(self, outputs)
        calls, self._calls = self._calls, []
        for fn, then in calls:
            result = fn()
            if then is not None:
                then(result)
        self._kick()

    def _note_scheduled(self) -> None:
        """Requests tracked and no longer waiting started computing in the step just begun."""
        waiting = {seq.request_id for seq in self.engine.scheduler.waiting}
        now = self._loop.now
        for request_id, since in list(self._queued_since.items()):
            if request_id not in waiting:
                del self._queued_since[request_id]
                self.queue_waits[request_id] = now - since
