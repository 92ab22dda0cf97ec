"""One request's life behind the router: route, reserve, prefill, transfer, decode, retry, abort.

The router owns the handoff's lifecycle (DESIGN.md): it asks the decode worker for a
reservation, has the prefill worker push and commit, then streams the decode worker's tokens.
Any failure of a worker or a transfer ends in another attempt on other workers (or a local
prefill); tokens already sent to the client are never re-sent: a retry continues from them by
treating them as part of the prompt. However the request ends (finish, client cancel, error),
both workers are told to abort, which is idempotent, so no blocks stay reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from pdserve.core.messages import PrefillResult, TokenBatch, WorkRequest
from pdserve.core.sampling_params import SamplingParams
from pdserve.telemetry import carrier_of
from router.worker_pool import WorkerPool

log = logging.getLogger(__name__)


class NoWorkerAvailable(RuntimeError):
    """No healthy worker can serve the request (after retries)."""


class Overloaded(RuntimeError):
    """Admission control refused the request."""


@dataclass
class Route:
    """Where one attempt runs: prefill_worker None means the decode worker prefills locally."""

    decode_worker: str
    prefill_worker: str | None
    estimates: dict = field(default_factory=dict)  # the policy's numbers, for tracing


@dataclass
class Progress:
    """What the server needs to build responses: the stream so far and where time went."""

    received: float  # perf_counter at receipt
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    first_token_at: float | None = None
    prefill_worker: str = ""
    decode_worker: str = ""
    disaggregated: bool = False
    attempts: int = 0
    route: Route | None = None


# (prompt_ids, max_tokens, exclude) -> Route; raises Overloaded / NoWorkerAvailable
RouteChooser = Callable[[list[int], int, set[str]], Route]


class RequestFlow:
    def __init__(
        self,
        pool: WorkerPool,
        choose_route: RouteChooser,
        max_retries: int,
        on_prefill_done: Callable[[Route, PrefillResult | TokenBatch], None] | None = None,
        block_size: int = 0,  # only to report cached blocks as tokens in traces
    ) -> None:
        self._pool = pool
        self._choose_route = choose_route
        self._max_retries = max_retries
        self._on_prefill_done = on_prefill_done
        self._block_size = block_size

    async def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        trace_context: dict[str, str],
        progress: Progress,
    ) -> AsyncIterator[TokenBatch]:
        """Yields the request's token batches, the last one finished. `trace_context` is the
        request's span; each attempt is a child span whose context the workers receive."""
        from router import observability  # imports this module

        emitted: list[int] = []
        excluded: set[str] = set()
        last_error: Exception | None = None
        for attempt in range(self._max_retries + 1):
            progress.attempts = attempt + 1
            remaining = sampling.max_tokens - len(emitted)
            work_id = f"{request_id}#{attempt}" if attempt else request_id
            span = observability.start_attempt(trace_context, attempt + 1, work_id)
            work = WorkRequest(
                request_id=work_id,
                # A retry continues after what the client already has: those tokens join the
                # prompt, which keeps greedy output identical to an uninterrupted run.
                prompt_token_ids=prompt_ids + emitted,
                sampling=dataclasses.replace(sampling, max_tokens=remaining),
                trace_context=carrier_of(span),
            )
            outcome, error = "cancelled", None  # unless the attempt ends otherwise
            try:
                candidates = [w for w in self._pool.workers if w not in excluded]
                with observability.routing_span(span, candidates, self._block_size) as record:
                    route = self._choose_route(work.prompt_token_ids, remaining, excluded)
                    record(route)
                progress.route = route
                async for batch in self._attempt(work, route, progress, span):
                    emitted += batch.token_ids
                    progress.completion_tokens = len(emitted)
                    yield batch
                    if batch.finished:
                        outcome = "ok"
                        return
                raise NoWorkerAvailable("worker stream ended without finishing")
            except (NoWorkerAvailable, Overloaded) as exc:
                outcome = "rejected" if isinstance(exc, Overloaded) else "unavailable"
                error = exc
                raise
            except Exception as exc:  # a worker or transfer failed: try elsewhere
                outcome, error, last_error = "failed", exc, exc
                failed = getattr(exc, "worker_id", None) or route.decode_worker
                excluded.add(failed)
                log.warning(
                    "request %s attempt %d failed on %s: %s", request_id, attempt + 1, failed, exc
                )
            finally:
                observability.end_attempt(span, outcome, error)
        raise NoWorkerAvailable(
            f"request failed after {self._max_retries + 1} attempts: {last_error}"
        )

    async def _attempt(
        self, work: WorkRequest, route: Route, progress: Progress, span: Span
    ) -> AsyncIterator[TokenBatch]:
        decode = self._pool.workers[route.decode_worker]
        prefill = self._pool.workers[route.prefill_worker] if route.prefill_worker else None
        prompt_tokens = len(work.prompt_token_ids)
        for worker in (decode, prefill):
            if worker:
                worker.inflight += 1
                worker.routed_since_poll += 1
                worker.routed_tokens_since_poll += prompt_tokens
        try:
            if prefill is None:
                stream = self._local(work, route, progress)
            else:
                stream = self._disaggregated(work, route, progress, span)
            async for batch in stream:
                yield batch
        finally:
            decode.inflight -= 1
            if prefill:
                prefill.inflight -= 1
            # Idempotent on both sides; shielded so a client cancel cannot skip it.
            await asyncio.shield(self._abort_everywhere(work.request_id, route))

    async def _local(
        self, work: WorkRequest, route: Route, progress: Progress
    ) -> AsyncIterator[TokenBatch]:
        decode = self._pool.workers[route.decode_worker].actor
        progress.prefill_worker = progress.decode_worker = route.decode_worker
        progress.disaggregated = False
        await _call(route.decode_worker, decode.generate.remote(work))
        first = True
        async for batch in _stream(route.decode_worker, decode.stream.remote(work.request_id)):
            if first and batch.prefill_s is not None:
                progress.prefill_s = batch.prefill_s
                progress.cached_tokens = batch.num_cached_tokens
                if self._on_prefill_done:
                    self._on_prefill_done(route, batch)
            first = False
            yield batch

    async def _disaggregated(
        self, work: WorkRequest, route: Route, progress: Progress, span: Span
    ) -> AsyncIterator[TokenBatch]:
        from router import observability

        decode = self._pool.workers[route.decode_worker].actor
        prefill = self._pool.workers[route.prefill_worker].actor
        reservation = await _call(route.decode_worker, decode.reserve.remote(work))
        if reservation is None:
            raise _WorkerFailed(route.decode_worker, "no free KV blocks for the reservation")
        try:
            result: PrefillResult = await _call(
                route.prefill_worker, prefill.prefill.remote(work, reservation)
            )
        except _WorkerFailed as exc:
            observability.transfer_failed(exc)
            raise
        observability.transfer_done(span, result)
        progress.prefill_worker, progress.decode_worker = route.prefill_worker, route.decode_worker
        progress.disaggregated = True
        progress.cached_tokens = result.num_cached_tokens
        progress.queue_s, progress.prefill_s = result.queue_s, result.prefill_s
        progress.transfer_s = result.transfer_s
        if self._on_prefill_done:
            self._on_prefill_done(route, result)
        yield TokenBatch(
            request_id=work.request_id,
            token_ids=[result.first_token_id],
            logprobs=[] if result.first_logprob is None else [result.first_logprob],
            text=result.text,
            finished=result.finished,
            finish_reason=result.finish_reason,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
        )
        if result.finished:
            return
        async for batch in _stream(route.decode_worker, decode.stream.remote(work.request_id)):
            yield batch

    async def _abort_everywhere(self, request_id: str, route: Route) -> None:
        for worker_id in {route.decode_worker, route.prefill_worker} - {None}:
            try:
                await self._pool.workers[worker_id].actor.abort.remote(request_id)
            except Exception as exc:  # a dead worker's blocks died with it
                log.info("abort of %s on %s failed: %s", request_id, worker_id, exc)


class _WorkerFailed(RuntimeError):
    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(f"{worker_id}: {message}")
        self.worker_id = worker_id


async def _call(worker_id: str, ref):
    """Awaits a Ray call, tagging any failure with the worker it came from."""
    try:
        return await ref
    except Exception as exc:
        raise _WorkerFailed(worker_id, f"{type(exc).__name__}: {exc}") from exc


async def _stream(worker_id: str, generator) -> AsyncIterator[TokenBatch]:
    try:
        async for ref in generator:
            batch: TokenBatch = await ref
            if batch.finished and batch.finish_reason == "abort":
                raise _WorkerFailed(worker_id, "stream ended by the worker (aborted or expired)")
            yield batch
    except _WorkerFailed:
        raise
    except Exception as exc:
        raise _WorkerFailed(worker_id, f"{type(exc).__name__}: {exc}") from exc
