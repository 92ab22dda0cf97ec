"""One request's life behind the router: route, reserve, prefill, transfer, decode, retry, abort.

The router owns the handoff's lifecycle (docs/design.md): it asks the decode worker for a
reservation, streams the prefill worker's first token as soon as it is sampled, has the prefill
worker push and commit meanwhile, then streams the decode worker's tokens.
Any failure of a worker or a transfer ends in another attempt on other workers (or a local
prefill); tokens already sent to the client are never re-sent: a retry continues from them by
treating them as part of the prompt, drawing seeded samples where the stream left off, and the
text is decoded by the router over all of them (router/output_text.py). A worker that sends
nothing and answers no stats poll for `progress_timeout_s` (0 = never) counts as failed: it
may be frozen, not dead. Workers at capacity are not failed (a reservation without room for the
prompt's KV, or the policy finding every option full): the request waits up to `room_wait_s`
for room, then is refused as overloaded (RESOURCE_EXHAUSTED); while it waits, admission control
counts it as pending (`waiting_for_room`), and refuses it at once if the router is full. However the request ends (finish, client
cancel, deadline, error), both workers of every attempt are told to abort, which is
idempotent, so no blocks stay reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from opentelemetry.trace import Span

from pdserve.core.messages import PrefillResult, TokenBatch, WorkRequest
from pdserve.core.sampling_params import SamplingParams
from pdserve.telemetry import carrier_of
from pdserve.tokenizer import Tokenizer
from router import observability
from router.attempts import NoRoom, continuation, grammar_refusal, of_client_prompt, remaining
from router.output_text import ChoiceOutputs, per_token
from router.peer_pull import start_pull
from router.types import (
    AtCapacity,
    NoWorkerAvailable,
    Overloaded,
    Progress,
    Route,
    RouteChooser,
)
from router.waiting import WaitingRequests
from router.worker_pool import WorkerPool, failure_reason
from router.worker_watch import WorkerFailed, WorkerWatch

log = logging.getLogger(__name__)

# Pauses between the tries of a request waiting for room, growing up to the last.
_ROOM_BACKOFF_S = (0.02, 0.05, 0.1, 0.2)


class RequestFlow:
    def __init__(
        self,
        pool: WorkerPool,
        choose_route: RouteChooser,
        tokenizer: Tokenizer,
        *,
        max_retries: int,
        progress_timeout_s: float,
        room_wait_s: float = 2.0,
        on_prefill_done: Callable[[Route, PrefillResult | TokenBatch], None] | None = None,
        on_prompt_computed: Callable[[Route], None] | None = None,
        on_output_computed: Callable[[Route, list[int]], None] | None = None,
        block_size: int = 0,  # only to report cached blocks as tokens in traces
    ) -> None:
        """`on_prefill_done(route, result)`: the prefill is over (a remote one pushed and
        committed). `on_prompt_computed(route)`: a remote prefill's first answer, before the
        push (a local one's is `on_prefill_done`). `on_output_computed(route, token_ids)`: a
        request of one choice finished there, its decode worker having computed the KV of
        `token_ids` (prompt and output but the last token)."""
        self._pool = pool
        self._choose_route = choose_route
        self._tokenizer = tokenizer
        self._max_retries = max_retries
        self._progress_timeout_s = progress_timeout_s
        self._watch = WorkerWatch(pool, progress_timeout_s)
        self._room_wait_s = room_wait_s
        self._on_prefill_done = on_prefill_done
        self._on_prompt_computed = on_prompt_computed
        self._on_output_computed = on_output_computed
        self._block_size = block_size
        # Requests between attempts, waiting for room (admission control counts them).
        self.waiting_for_room = WaitingRequests("waiting for room")
        self._running: set[asyncio.Task] = set()  # the tasks of the requests running now
        self._unawaited_aborts: set[asyncio.Future] = set()  # sent to failed workers
        self._closed = False

    async def close(self, timeout_s: float = 5.0) -> None:
        """At shutdown, once the servers have drained, before the workers and Ray stop: ends
        the requests still running, and any later abort is skipped (the workers go with the
        router; an abort after Ray stopped would start a new local Ray for itself)."""
        self._closed = True
        for task in (*self._running, *self._unawaited_aborts):
            task.cancel()
        if self._running:
            await asyncio.wait(set(self._running), timeout=timeout_s)

    async def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        trace_context: dict[str, str],
        progress: Progress,
        one_token_per_batch: bool = False,
    ) -> AsyncIterator[TokenBatch]:
        """Yields the request's token batches, each of one choice (`index`), until every
        choice finished; with `one_token_per_batch`, a worker's batch of several tokens is
        yielded token by token (output_text.per_token). `trace_context` is the request's
        span; each attempt is a child span whose context the workers receive. A request with
        n > 1 runs its choices together (one prefill, forked); once some choice has sent
        tokens, a failed attempt continues each unfinished choice on its own, one after
        another, each exactly as a single request with its seed (seed + index) would
        continue."""
        task = asyncio.current_task()
        self._running.add(task)
        try:
            run = self._run(
                request_id, prompt_ids, sampling, trace_context, progress, one_token_per_batch
            )
            async with aclosing(run) as batches:
                async for batch in batches:
                    yield batch
        finally:
            self._running.discard(task)

    async def _run(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        trace_context: dict[str, str],
        progress: Progress,
        one_token_per_batch: bool,
    ) -> AsyncIterator[TokenBatch]:
        choices = ChoiceOutputs(self._tokenizer, prompt_ids, sampling)
        units = [list(range(sampling.n))]  # the choices of each work still to run
        excluded: set[str] = set()
        failures, room_waits = 0, 0
        waiting_for_room_since: float | None = None
        while True:
            if waiting_for_room_since is not None:
                # Pending meanwhile; refused at once (Overloaded) when the router is full.
                with self.waiting_for_room.held():
                    await asyncio.sleep(_ROOM_BACKOFF_S[min(room_waits, len(_ROOM_BACKOFF_S) - 1)])
                room_waits += 1
            progress.attempts += 1
            attempt = progress.attempts
            work_id = f"{request_id}#{attempt - 1}" if attempt > 1 else request_id
            span = observability.start_attempt(trace_context, attempt, work_id)
            unit = units[0]
            work = continuation(work_id, prompt_ids, choices, unit, sampling, carrier_of(span))
            outcome, error, route = "cancelled", None, None  # unless the attempt ends otherwise
            try:
                candidates = [w for w in self._pool.workers if w not in excluded]
                with observability.routing_span(span, candidates, self._block_size) as record:
                    route = await self._choose_route(
                        work.prompt_token_ids, work.sampling.max_tokens, excluded
                    )
                    record(route)
                progress.route = route
                async with aclosing(self._attempt(work, route, progress, span)) as batches:
                    async for batch in batches:
                        batch = dataclasses.replace(batch, index=unit[batch.index])
                        for piece in per_token(batch) if one_token_per_batch else (batch,):
                            piece = choices.take(piece)
                            progress.completion_tokens = choices.num_tokens
                            yield piece
                            if choices.finished[piece.index]:
                                break  # a stop string ended it: the rest is not the client's
                        if all(choices.finished[i] for i in unit):
                            break
                    else:
                        raise WorkerFailed(route.decode_worker, "stream ended without finishing")
                outcome = "ok"
                units.pop(0)
                if not units:
                    if self._on_output_computed and sampling.n == 1:
                        self._on_output_computed(route, prompt_ids + choices.emitted[0][:-1])
                    return
            except (NoRoom, AtCapacity) as exc:  # full workers, not broken ones: wait for room
                outcome, error = "no_room", exc
                now = time.monotonic()
                waiting_for_room_since = waiting_for_room_since or now
                waited = now - waiting_for_room_since
                if waited >= self._room_wait_s:
                    outcome = "rejected"
                    raise Overloaded(f"{exc} (waited {waited:.1f} s for room)") from exc
            except (NoWorkerAvailable, Overloaded) as exc:
                outcome = "rejected" if isinstance(exc, Overloaded) else "unavailable"
                error = exc
                raise
            except Exception as exc:  # a worker or transfer failed: try elsewhere
                refusal = grammar_refusal(exc)
                if refusal is not None:  # the request's grammar is at fault, not the worker
                    outcome, error = "rejected", refusal
                    raise refusal from None
                outcome, error = "failed", exc
                if route is None:  # routing itself broke: a bug, not a worker failure
                    raise
                failed = exc.worker_id if isinstance(exc, WorkerFailed) else route.decode_worker
                excluded.add(failed)
                self._pool.note_failure(
                    failed, exc.reason if isinstance(exc, WorkerFailed) else failure_reason(exc)
                )
                failures += 1
                log.warning(
                    "request %s attempt %d failed on %s: %s", request_id, attempt, failed, exc
                )
                if failures > self._max_retries:
                    raise NoWorkerAvailable(
                        f"request failed after {failures} attempts: {exc}"
                    ) from exc
                units[0:1] = remaining(unit, choices, sampling)
            finally:
                observability.end_attempt(span, outcome, error)

    async def _attempt(
        self, work: WorkRequest, route: Route, progress: Progress, span: Span
    ) -> AsyncIterator[TokenBatch]:
        workers = [w for w in (route.decode_worker, route.prefill_worker) if w]
        try:
            with self._pool.occupied(workers):
                if route.prefill_worker is None:
                    stream = self._local(work, route, progress)
                else:
                    stream = self._disaggregated(work, route, progress, span)
                async with aclosing(stream):
                    async for batch in stream:
                        yield batch
        finally:
            # Idempotent on both sides; shielded so a client cancel cannot skip it.
            await asyncio.shield(self._abort_everywhere(work.request_id, workers))

    async def _local(
        self, work: WorkRequest, route: Route, progress: Progress
    ) -> AsyncIterator[TokenBatch]:
        decode = self._pool.workers[route.decode_worker].handle
        progress.prefill_worker = progress.decode_worker = route.decode_worker
        progress.disaggregated = False
        pull = route.peer_pull
        pulling = pull is not None and await self._watch.guarded(
            route.decode_worker, start_pull(self._pool, work, route.decode_worker, pull)
        )
        if not pulling:  # no pull, or no room to reserve one: the plain local prefill
            await self._watch.guarded(route.decode_worker, decode.generate(work))
        first = True
        async for batch in self._watch.guarded_stream(
            route.decode_worker, decode.stream(work.request_id)
        ):
            if first and batch.prefill_s is not None:
                progress.prefill_s = batch.prefill_s
                progress.cached_tokens = of_client_prompt(batch.num_cached_tokens, progress)
                if self._on_prefill_done:
                    self._on_prefill_done(route, batch)
            first = False
            yield batch

    async def _disaggregated(
        self, work: WorkRequest, route: Route, progress: Progress, span: Span
    ) -> AsyncIterator[TokenBatch]:
        decode = self._pool.workers[route.decode_worker].handle
        prefill = self._pool.workers[route.prefill_worker].handle
        reservation = await self._watch.guarded(route.decode_worker, decode.reserve(work))
        if reservation is None:
            raise NoRoom(f"decode worker {route.decode_worker} has no free KV blocks")
        progress.prefill_worker, progress.decode_worker = route.prefill_worker, route.decode_worker
        progress.disaggregated = True
        # The prefill worker answers twice: at the first token, which goes to the client at once,
        # then once the KV is pushed and committed. The push writes into the decode worker: a
        # frozen receiver stalls it as surely as a frozen sender, so both are watched.
        results = prefill.prefill(work, reservation)
        async with aclosing(results):
            result = await self._prefill_stage(route, results)
            if self._on_prompt_computed:
                self._on_prompt_computed(route)
            progress.cached_tokens = of_client_prompt(result.num_cached_tokens, progress)
            progress.queue_s, progress.prefill_s = result.queue_s, result.prefill_s
            if not work.sampling.beam_search:  # a beam search starts on the decode worker
                yield TokenBatch(
                    request_id=work.request_id,
                    token_ids=[result.first_token_id],
                    logprobs=[] if result.first_logprob is None else [result.first_logprob],
                    text="",  # the router decodes the text (OutputText)
                    finished=result.finished,
                    finish_reason=result.finish_reason,
                    num_prompt_tokens=result.num_prompt_tokens,
                    num_cached_tokens=result.num_cached_tokens,
                )
            if not result.finished:
                result = await self._prefill_stage(route, results)
                progress.transfer_s = result.transfer_s
            observability.transfer_done(span, result)
            if self._on_prefill_done:
                self._on_prefill_done(route, result)
        if result.finished:
            return
        async for batch in self._watch.guarded_stream(
            route.decode_worker, decode.stream(work.request_id)
        ):
            yield batch

    async def _prefill_stage(
        self, route: Route, results: AsyncIterator[PrefillResult]
    ) -> PrefillResult:
        """The prefill worker's next answer; a transfer failure is traced as one."""
        try:
            return await self._watch.guarded(
                route.prefill_worker, anext(results), also_watch=route.decode_worker
            )
        except StopAsyncIteration as exc:  # the worker broke its protocol: a failure too
            raise WorkerFailed(route.prefill_worker, "prefill ended without a result") from exc
        except WorkerFailed as exc:
            observability.transfer_failed(exc)
            raise

    async def _abort_everywhere(self, request_id: str, worker_ids: list[str]) -> None:
        """Tells every worker of the attempt to abort, at once; a frozen one is not waited for
        beyond the progress timeout (its call is queued and runs when it thaws), one just failed
        over not at all. Nothing once closed (shutdown)."""
        if self._closed:
            return

        async def abort(worker_id: str) -> None:
            handle = self._pool.workers[worker_id].handle
            try:
                await asyncio.wait_for(handle.abort(request_id), self._progress_timeout_s)
            except Exception as exc:  # a dead worker's blocks died with it
                log.info("abort of %s on %s failed: %s", request_id, worker_id, exc)

        # A worker just failed over is not waited for: its abort is sent, and the retry goes on.
        healthy = [w for w in worker_ids if self._pool.workers[w].healthy]
        for worker_id in set(worker_ids) - set(healthy):
            sent = asyncio.ensure_future(abort(worker_id))
            self._unawaited_aborts.add(sent)
            sent.add_done_callback(self._unawaited_aborts.discard)
        await asyncio.gather(*(abort(w) for w in healthy))
