"""One validated request driven through RequestFlow, as every client API runs it.

The gRPC servicer (router/generation_service.py) and the OpenAI HTTP API (router/http/) differ
only in how they decode requests and encode responses; what lies between is here: the request
id in the logs, the request's span and latency metrics, the trace context the workers continue,
and the time of each batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass

from pdserve import metrics
from pdserve.core.messages import TokenBatch
from pdserve.logging_setup import request_id_var
from router.observability import RequestObserver
from router.request_flow import RequestFlow
from router.traffic_window import SERVED
from router.types import Progress
from router.validation import ValidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One batch as the client gets it: `at` is its perf_counter time; `first` marks the batch
    that carries the first token, `last` the one that finishes the request's last choice."""

    batch: TokenBatch
    at: float
    first: bool
    last: bool = False


def w3c_context(metadata: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace headers among a request's metadata (lower-case keys)."""
    return {k: metadata[k] for k in ("traceparent", "tracestate") if k in metadata}


async def run_request(
    flow: RequestFlow,
    observer: RequestObserver | None,
    valid: ValidRequest,
    metadata: Mapping[str, str],
    progress: Progress,
    model: str,
    one_token_per_batch: bool = False,
) -> AsyncIterator[Step]:
    """Yields the request's batches (each of one choice; every choice's last one finished);
    raises what RequestFlow raises.
    Closing it early (a client that went away) aborts the request on its workers. With an
    observer, the request is counted under `model`'s metrics too (pdserve/metrics/).
    `one_token_per_batch`: RequestFlow.run's."""
    # Each request runs in its own asyncio task (own context copy): the id needs no reset, and
    # every log line of this request, here or in the request flow, carries it.
    request_id_var.set(valid.request_id)
    observation = observer.start(valid.request_id, metadata, progress) if observer else None
    trace_context = observation.trace_context if observation else w3c_context(metadata)
    finish_reason, error, last_at = None, None, None
    last_response_at = progress.received  # of the latest token-carrying response
    open_choices = valid.sampling.n
    try:
        batches = flow.run(
            valid.work_id,
            valid.prompt_ids,
            valid.sampling,
            trace_context,
            progress,
            one_token_per_batch,
        )
        async with aclosing(batches):
            async for batch in batches:
                now = time.perf_counter()
                first = progress.first_token_at is None
                if first:
                    progress.first_token_at = now
                if observation:
                    observation.on_tokens(len(batch.token_ids), now)
                    if not first and batch.token_ids:
                        metrics.MODEL_ITL_SECONDS.labels(model).observe(now - last_response_at)
                if batch.token_ids:
                    last_response_at = now
                if batch.finished:
                    open_choices -= 1
                    finish_reason, last_at = batch.finish_reason, now
                yield Step(batch, now, first, last=open_choices == 0)
    except (asyncio.CancelledError, GeneratorExit) as exc:
        # An ordinary event (a client that went away, a deadline): one line, no traceback.
        error = exc
        log.info(
            "request %s cancelled by the client after %d tokens",
            valid.request_id,
            progress.completion_tokens,
        )
        raise
    except BaseException as exc:  # an error: recorded (the API answers it)
        error = exc
        raise
    finally:
        if observation:
            observation.finish(finish_reason, error)
            _count(model, progress, finish_reason, last_at)


def _count(model: str, p: Progress, finish_reason: str | None, last_at: float | None) -> None:
    first = p.first_token_at
    metrics.observe_request(
        model,
        finished_reason=finish_reason,
        prompt_tokens=p.prompt_tokens,
        cached_tokens=p.cached_tokens,
        completion_tokens=p.completion_tokens,
        queue_s=p.queue_s,
        ttft_s=None if first is None else first - p.received,
        e2e_s=None if last_at is None else last_at - p.received,
    )
    if first is not None:
        SERVED.record(p.prompt_tokens, p.completion_tokens, p.received)
