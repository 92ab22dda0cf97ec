"""What every worker actor has, whatever its role: an engine on its thread, its costs, its stats.

The prefill and decode actors compose one WorkerRuntime each. The runtime measures the engine's
step costs (the router's cost model learns from them), turns engine outputs into TokenBatches,
and feeds the engine's KV events to the prefix index. It also sets up the worker process from
its WorkerSpec: CPU affinity, logging, tracing (exporters from the forwarded `OTEL_*`
variables) and, when `spec.worker.metrics_port` is set (0 = an ephemeral port), the worker's
Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path

from pdserve import metrics
from pdserve.core.messages import ENGINE_COUNT_FIELDS, TokenBatch, WorkerStats
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.models.builtin import default_model_dir
from pdserve.worker import memory_usage
from pdserve.worker.engine_loop import END_OF_STREAM, EngineLoop
from pdserve.worker.worker_spec import WorkerSpec

log = logging.getLogger(__name__)


class WorkerRuntime:
    def __init__(self, worker_id: str, role: str, spec: WorkerSpec) -> None:
        if spec.cpu_affinity:
            os.sched_setaffinity(0, spec.cpu_affinity)
        engine_config = spec.engine
        self.worker_id = worker_id
        self.role = role
        self.metrics_port = _setup_process(role, spec)
        # A new epoch each time the actor (re)starts: the prefix index drops older entries.
        self.epoch = time.time_ns()
        engine_config.model = engine_config.model or str(default_model_dir())
        self.index_feeder = None
        if spec.redis_url:
            from pdserve.prefix_index.feeder import IndexFeeder

            self.index_feeder = IndexFeeder(
                spec.redis_url,
                worker_id,
                self.epoch,
                model=Path(engine_config.model).name,
                block_size=engine_config.block_size,
                heartbeat_ttl_s=spec.worker.prefix_heartbeat_ttl_s,
            )
        sink = self.index_feeder.enqueue if self.index_feeder else None
        self.rank_group = None
        if engine_config.tp > 1:  # rank 0 of a tensor-parallel worker
            from pdserve.worker.rank_group import RankGroup

            self.rank_group = RankGroup(worker_id, role, spec)
        executor = self.rank_group.executor if self.rank_group else None
        # The router decodes the client's text over every attempt (router/output_text.py).
        self.engine = LLMEngine(
            engine_config, kv_event_sink=sink, emit_text=False, executor=executor
        )
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop())
        self.loop.step_listeners.append(self._measure_step)
        self._stats = WorkerStats(
            worker_id=worker_id,
            role=role,
            epoch=self.epoch,
            block_size=self.engine.block_size,
            bytes_per_block=self.engine.bytes_per_block,
        )
        self._last_prefill_tokens = 0
        self._observed: WorkerStats | None = None  # the previous stats() answer
        # Queue wait of requests that asked for it (track_queue): engine-thread state.
        self._waiting_since: dict[str, float] = {}
        self._queue_waits: dict[str, float] = {}

    @property
    def bytes_per_block(self) -> int:
        return self._stats.bytes_per_block

    def set_role(self, role: str) -> None:
        """A switchable worker's new role (pdserve/worker/switchable_worker.py): its stats say
        it, so the router's cost model reads its next prefill as local or remote rightly."""
        self.role = self._stats.role = role

    def track_queue(self, request_id: str) -> None:
        """Call on the engine thread right after add_request: queue_wait() will tell how long
        the request waited for its first step."""
        self._waiting_since[request_id] = time.perf_counter()

    def queue_wait(self, request_id: str) -> float:
        """Seconds from track_queue to the start of the request's first step (0.0 if it never
        got one); forgets the request."""
        self._waiting_since.pop(request_id, None)
        return self._queue_waits.pop(request_id, 0.0)

    # Runs on the engine thread after every step.
    def _measure_step(self, outputs: list[RequestOutput], seconds: float) -> None:
        if self._waiting_since:
            self._note_scheduled(time.perf_counter() - seconds)
        # The counter alone, not engine.stats(): every step reads it.
        computed_so_far = self.engine.step_outputs.prefill_tokens_computed
        computed = computed_so_far - self._last_prefill_tokens
        self._last_prefill_tokens = computed_so_far
        if computed > 0:
            self._stats.prefill_tokens += computed
            self._stats.prefill_seconds += seconds
            self._stats.prefill_steps += 1
        elif outputs:
            self._stats.decode_steps += 1
            self._stats.decode_seconds += seconds
            self._stats.decode_tokens += sum(len(o.new_token_ids) for o in outputs)

    def _note_scheduled(self, step_started: float) -> None:
        # A tracked request no longer in the scheduler's waiting queue ran in this step.
        waiting = {seq.request_id for seq in self.engine.scheduler.waiting}
        for request_id, since in list(self._waiting_since.items()):
            # pop, not del: queue_wait() may forget it from the event loop meanwhile.
            if request_id not in waiting and self._waiting_since.pop(request_id, None):
                self._queue_waits[request_id] = max(0.0, step_started - since)

    async def stats(self) -> WorkerStats:
        engine_stats = await self.loop.acall(self.engine.stats)
        stats = self._stats
        for name in ENGINE_COUNT_FIELDS:
            setattr(stats, name, int(engine_stats.get(name, 0)))
        stats.sim_overrun_steps = int(engine_stats.get("sim_overrun_steps", 0))
        stats.sim_modelled_seconds = float(engine_stats.get("sim_modelled_seconds", 0.0))
        stats.sim_measured_seconds = float(engine_stats.get("sim_measured_seconds", 0.0))
        expert_tokens = engine_stats.get("expert_tokens", [])
        stats.expert_tokens, stats.expert_load_imbalance = metrics.expert_load(expert_tokens)
        stats.peak_rss_bytes = memory_usage.peak_rss_bytes()
        stats.peak_gpu_bytes = memory_usage.peak_gpu_bytes()
        stats.engine_failure = self.loop.failure
        snapshot = WorkerStats(**asdict(stats))
        # The router polls stats a few times a second: fresh enough for gauges, free per step;
        # counters grow by what happened since the previous poll.
        metrics.observe_worker_stats(snapshot, self._observed)
        self._observed = snapshot
        return snapshot

    def record_transfer(
        self, num_bytes: int, seconds: float, failed: bool = False, reason: str = "other"
    ) -> None:
        if failed:
            self._stats.transfer_failures += 1
            metrics.KV_TRANSFER_FAILURES.labels(reason=reason).inc()
        else:
            self._stats.transfer_bytes += num_bytes
            self._stats.transfer_seconds += seconds
            metrics.KV_TRANSFER_BYTES.inc(num_bytes)
            metrics.KV_TRANSFER_SECONDS.observe(seconds)

    async def abort(self, request_id: str) -> None:
        """Frees the request's blocks at once and ends its stream. Idempotent."""
        await self.loop.acall(lambda: self.engine.abort(request_id))
        self.loop.close_stream(request_id)

    async def batches(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[TokenBatch]:
        """Yields TokenBatches from a request's output queue: everything queued is one batch
        per choice (n > 1 interleaves choices; `index` tells them apart)."""
        while True:
            items = [await stream.get()]
            while not stream.empty():
                items.append(stream.get_nowait())
            by_choice: dict[int, TokenBatch] = {}
            ended = False
            for item in items:
                if item is END_OF_STREAM:
                    aborted = TokenBatch(
                        request_id,
                        [],
                        [],
                        "",
                        finished=True,
                        finish_reason="abort",
                        error=self.loop.failure,
                    )
                    by_choice[-1], ended = aborted, True
                    break
                batch = by_choice.get(item.index)
                if batch is None:
                    batch = by_choice[item.index] = TokenBatch(
                        request_id=request_id, token_ids=[], logprobs=[], text="", index=item.index
                    )
                batch.token_ids += item.new_token_ids
                batch.logprobs += item.new_logprobs or []
                batch.num_prompt_tokens = item.num_prompt_tokens
                batch.num_cached_tokens = item.num_cached_tokens
                batch.num_draft_tokens += item.num_draft_tokens
                batch.num_accepted_tokens += item.num_accepted_tokens
                if item.finished:
                    batch.finished, batch.finish_reason = True, item.finish_reason
                    batch.cumulative_logprob, batch.score = item.cumulative_logprob, item.score
                if item.ends_request:
                    ended = True
                    break
            for batch in by_choice.values():
                yield batch
            if ended:
                return

    def shutdown(self) -> None:
        self.loop.stop()
        if self.rank_group:
            self.rank_group.stop()
        if self.index_feeder:
            self.index_feeder.stop()


def _setup_process(role: str, spec: WorkerSpec) -> int | None:
    """Logging, tracing and the metrics endpoint of this worker process; returns the bound
    metrics port (None: no endpoint). A runtime is created once per actor process."""
    from pdserve.logging_setup import setup_logging
    from pdserve.telemetry import setup_tracing

    setup_logging(spec.log.level, spec.log.format)
    setup_tracing(f"pdserve-{role}")
    if spec.worker.metrics_port is None:
        return None
    # Several workers share a node: a fixed port serves only the first one there, use 0.
    bound = metrics.start_metrics_server(spec.worker.metrics_port)
    log.info("%s worker metrics on port %d", role, bound)
    return bound
