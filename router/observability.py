"""What the router records about each request: its spans and its Prometheus metrics.

One trace per request; the workers continue it from `WorkRequest.trace_context` (Ray calls)
and from the KV chunk headers and commit (the transfer):

    /pdserve.v1.Generation/Generate  router, SERVER (gRPC instrumentation; a child of the
    │                                client's `traceparent` when it sends one)
    └ pdserve.generate               router: the request as a whole (tokens, finish reason)
      ├ pdserve.first_token          router: arrival to first token, i.e. the TTFT as a bar
      └ pdserve.attempt              router: one per try (number, outcome); retries are siblings
        ├ pdserve.route              router: the decision (workers, cached tokens, estimates)
        ├ pdserve.decode.reserve     decode worker: blocks for the KV to arrive in
        ├ pdserve.prefill            prefill worker (pdserve.prefill.queue, .forward inside)
        │ └ pdserve.kv_transfer      prefill worker, CLIENT (bytes, chunks, transport, outcome)
        │   └ pdserve.kv_receive     decode worker, from the commit's trace context
        │     └ pdserve.decode.admit decode worker: the request joins the running batch
        └ pdserve.decode             decode worker: the token stream (first_token event;
                                     pdserve.spec.draft_tokens / .accepted_tokens: speculative
                                     decoding's verified and accepted drafts); a local
                                     prefill's pdserve.decode.admit is a sibling

Attributes are set only on recording spans, so with tracing off a request costs a few
non-recording span objects plus its metric updates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pdserve import metrics
from pdserve.core.messages import PrefillResult
from pdserve.telemetry import (
    carrier_from_grpc_metadata,
    carrier_of,
    extract_context,
    get_tracer,
    wall_ns,
)
from router.types import AtCapacity, NoWorkerAvailable, Overloaded, Progress, Route

_ESTIMATE_FIELDS = ("ttft_s", "tpot_s", "stall_s", "transfer_blocks", "objective", "load")


def _tracer() -> trace.Tracer:
    # Looked up per use, not cached at import: the provider is installed when the app starts.
    return get_tracer("pdserve.router")


class RequestObserver:
    """GenerationService's hook: `start` one RequestObservation per request."""

    def start(
        self, request_id: str, metadata: Mapping[str, str], progress: Progress
    ) -> RequestObservation:
        return RequestObservation(request_id, metadata, progress)


class RequestObservation:
    """The `pdserve.generate` span and the latency metrics of one request."""

    def __init__(self, request_id: str, metadata: Mapping[str, str], progress: Progress) -> None:
        self._progress = progress
        self._start_ns = wall_ns(progress.received)
        self._last_token_at: float | None = None
        self._finished = False
        # Under the gRPC instrumentation its server span is current (and already a child of the
        # client's traceparent); without it, continue the client's context from the metadata.
        server_span = trace.get_current_span().get_span_context().is_valid
        parent = (
            None if server_span else extract_context(carrier_from_grpc_metadata(metadata.items()))
        )
        self.span = _tracer().start_span(
            "pdserve.generate",
            context=parent,
            kind=SpanKind.INTERNAL if server_span else SpanKind.SERVER,
            start_time=self._start_ns,
            attributes={
                "pdserve.request_id": request_id,
                "pdserve.prompt_tokens": progress.prompt_tokens,
            },
        )
        self.trace_context = carrier_of(self.span)  # what RequestFlow hands to the workers

    def on_tokens(self, count: int, now: float) -> None:
        """A response carrying `count` tokens leaves at perf_counter time `now`."""
        if self._last_token_at is None:
            metrics.TTFT_SECONDS.observe(now - self._progress.received)
            self._first_token_span(now)
        else:
            metrics.ITL_SECONDS.observe(now - self._last_token_at)
        self._last_token_at = now

    def _first_token_span(self, now: float) -> None:
        if not self.span.is_recording():
            return
        p = self._progress
        first = _tracer().start_span(
            "pdserve.first_token",
            context=trace.set_span_in_context(self.span),
            start_time=self._start_ns,
            attributes={
                "pdserve.ttft_s": now - p.received,
                "pdserve.cached_tokens": p.cached_tokens,
                "pdserve.disaggregated": p.disaggregated,
                "pdserve.prefill_worker": p.prefill_worker,
                "pdserve.decode_worker": p.decode_worker,
            },
        )
        first.end(end_time=wall_ns(now))

    def finish(self, finish_reason: str | None, exc: BaseException | None) -> None:
        """The request ended: normally (`finish_reason`) or with `exc`. Idempotent."""
        if self._finished:
            return
        self._finished = True
        p, last = self._progress, self._last_token_at
        outcome = _outcome(finish_reason, exc)
        metrics.REQUESTS.labels(outcome=outcome).inc()
        if outcome in ("stop", "length") and last is not None:
            metrics.E2E_SECONDS.observe(last - p.received)
            if p.completion_tokens > 1 and p.first_token_at is not None:
                metrics.TPOT_SECONDS.observe((last - p.first_token_at) / (p.completion_tokens - 1))
        if p.first_token_at is not None:  # the prompt was looked up and computed
            metrics.PREFIX_HIT_TOKENS.inc(p.cached_tokens)
            metrics.PREFIX_QUERY_TOKENS.inc(p.prompt_tokens)
        if self.span.is_recording():
            self.span.set_attributes(_summary(p, finish_reason, outcome, last))
            if exc is not None and outcome == "error":
                self.span.record_exception(exc)
                self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self.span.end()


def _outcome(finish_reason: str | None, exc: BaseException | None) -> str:
    if exc is None:
        return finish_reason or "error"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    if isinstance(exc, Overloaded):
        return "rejected"
    return "error"


def _summary(p: Progress, finish_reason: str | None, outcome: str, last: float | None) -> dict:
    summary = {
        "pdserve.outcome": outcome,
        "pdserve.finish_reason": finish_reason or "",
        "pdserve.completion_tokens": p.completion_tokens,
        "pdserve.cached_tokens": p.cached_tokens,
        "pdserve.attempts": p.attempts,
        "pdserve.disaggregated": p.disaggregated,
        "pdserve.prefill_worker": p.prefill_worker,
        "pdserve.decode_worker": p.decode_worker,
        "pdserve.queue_s": p.queue_s,
        "pdserve.prefill_s": p.prefill_s,
        "pdserve.transfer_s": p.transfer_s,
    }
    if p.first_token_at is not None:
        summary["pdserve.ttft_s"] = p.first_token_at - p.received
    if last is not None:
        summary["pdserve.e2e_s"] = last - p.received
    return summary


# ---- one attempt (called by RequestFlow) ---------------------------------------------------


def start_attempt(trace_context: Mapping[str, str], attempt: int, request_id: str) -> Span:
    """A `pdserve.attempt` span under the request's span (whose carrier is `trace_context`)."""
    return _tracer().start_span(
        "pdserve.attempt",
        context=extract_context(trace_context),
        attributes={"pdserve.attempt": attempt, "pdserve.request_id": request_id},
    )


def end_attempt(span: Span, outcome: str, exc: BaseException | None = None) -> None:
    """outcome: ok, failed (another attempt may follow), no_room (one follows after a brief
    wait), rejected, unavailable, cancelled."""
    if span.is_recording():
        span.set_attribute("pdserve.outcome", outcome)
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
    span.end()


@contextmanager
def routing_span(
    attempt: Span, candidates: list[str], block_size: int
) -> Iterator[Callable[[Route], None]]:
    """Times the routing decision in `pdserve.route`; call the yielded function with the route.
    Counts the decision (remote, local) or the refusal (rejected, at_capacity, unavailable)."""
    span = _tracer().start_span("pdserve.route", context=trace.set_span_in_context(attempt))
    try:
        yield lambda route: _record_route(span, route, candidates, block_size)
    except (Overloaded, NoWorkerAvailable) as exc:
        decision = _refusal(exc)
        metrics.ROUTING_DECISIONS.labels(decision=decision).inc()
        span.set_attribute("pdserve.route.decision", decision)
        span.set_attribute("pdserve.route.reason", str(exc))
        raise
    finally:
        span.end()


def _refusal(exc: Overloaded | NoWorkerAvailable) -> str:
    if isinstance(exc, AtCapacity):
        return "at_capacity"  # RequestFlow waits briefly for room and routes again
    return "rejected" if isinstance(exc, Overloaded) else "unavailable"


def _record_route(span: Span, route: Route, candidates: list[str], block_size: int) -> None:
    decision = "remote" if route.prefill_worker else "local"
    metrics.ROUTING_DECISIONS.labels(decision=decision).inc()
    if not span.is_recording():
        return
    attributes = {
        "pdserve.route.decision": decision,
        "pdserve.route.decode_worker": route.decode_worker,
        "pdserve.route.prefill_worker": route.prefill_worker or "",
        "pdserve.route.reason": route.reason,
        "pdserve.route.cached_tokens": route.cached_tokens,
        "pdserve.route.decode_cached_tokens": route.decode_cached_tokens,
        # Parallel lists: every worker the policy could pick and the prompt tokens it holds.
        "pdserve.route.candidates": candidates,
        "pdserve.route.candidate_cached_tokens": [
            route.cached_blocks.get(worker, 0) * block_size for worker in candidates
        ],
    }
    for name in _ESTIMATE_FIELDS:
        value = getattr(route.estimate, name, None)
        if isinstance(value, int | float):
            attributes[f"pdserve.route.estimate.{name}"] = value
    span.set_attributes(attributes)


def transfer_done(attempt: Span, result: PrefillResult) -> None:
    """The prefill worker pushed and committed the KV (nothing to push when it finished)."""
    if result.finished and not result.transfer_chunks:
        return
    metrics.KV_TRANSFER_BYTES.inc(result.transfer_bytes)
    metrics.KV_TRANSFER_SECONDS.observe(result.transfer_s)
    if attempt.is_recording():
        attempt.set_attribute("pdserve.kv.bytes", result.transfer_bytes)
        attempt.set_attribute("pdserve.kv.seconds", result.transfer_s)


def transfer_failed(exc: BaseException) -> None:
    """The prefill call failed: its push, its commit, or the worker itself."""
    metrics.KV_TRANSFER_FAILURES.labels(reason=metrics.transfer_failure_reason(exc)).inc()
