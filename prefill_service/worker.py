"""PrefillWorker: the Ray actor that computes prompts and pushes their KV to decode workers.

prefill() runs the prompt in prefill-only mode (the engine reuses this worker's prefix cache and
holds the blocks after sampling the first token) and hands the first token back at once, so the
router streams it to the client while the KV is still on its way (as DistServe and Splitwise
return the first token from the prefill instance); it then pushes the blocks the decode worker
lacks through the configured transport, commits with the first token, and releases the blocks —
to this worker's prefix cache, where a later request with the same prefix finds them. P never
holds blocks on D's behalf once its push is done, whatever the outcome, nor once the caller
stops listening. When either worker is tensor-parallel, every prefill rank pushes its own KV
heads to the decode ranks holding them, and this actor (rank 0) commits once all of them did
(kv_transfer/tp_handoff.py).

An abort may run before the prefill() it aborts has started, or between its stream opening and
its request reaching the engine (pdserve/worker/aborted_requests.py): prefill() checks the
remembered aborts before computing, on the engine thread as it adds the request, and before
pushing, so an aborted request is never computed, held or pushed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from pdserve import metrics
from pdserve.core.messages import KVReservation, PrefillResult, WorkRequest
from pdserve.logging_setup import bind_request_id
from pdserve.telemetry import extract_context, get_tracer, inject_context, wall_ns
from pdserve.worker.aborted_requests import AbortedRequests
from pdserve.worker.engine_loop import END_OF_STREAM
from pdserve.worker.worker_actor import WorkerActor
from pdserve.worker.worker_spec import WorkerSpec

if TYPE_CHECKING:  # torch; imported on the worker only, so the router can import this module
    from kv_transfer.base import CommitInfo, TransferResult
    from pdserve.worker.worker_runtime import WorkerRuntime

log = logging.getLogger(__name__)


class PrefillAborted(RuntimeError):
    """The request was aborted while it waited or computed on this worker."""


class PrefillWorker(WorkerActor):
    role = "prefill"

    def __init__(self, worker_id: str, spec: WorkerSpec) -> None:
        super().__init__(worker_id, spec)
        self._sender = None
        # Read by the engine thread too (in `add`): written before the abort reaches the engine.
        self._aborted = AbortedRequests()

    def _start_transport(self, runtime: WorkerRuntime) -> None:
        from kv_transfer.factory import make_sender

        self._sender = make_sender(self._kv_config, runtime.engine.kv_cache)

    async def prefill(
        self, request: WorkRequest, reservation: KVReservation
    ) -> AsyncIterator[PrefillResult]:
        """Computes the prompt and yields its result at the first token; then moves its KV to
        the reservation's decode worker, commits, and yields the same result again with the
        transfer's figures (unless the first token ended the request: nothing to hand over).

        Raises KVTransferError when the push or the commit fails (the caller retries),
        PrefillAborted when the request was aborted meanwhile. Traced as `pdserve.prefill`
        (a child of the router's attempt) with queue, forward and kv_transfer inside; not the
        current span across the yields, which hand control back to Ray.
        """
        runtime = await self._started()
        rid = request.request_id
        attributes = {
            "pdserve.request_id": rid,
            "pdserve.worker_id": self.worker_id,
            "pdserve.prompt_tokens": len(request.prompt_token_ids),
        }
        span = get_tracer("pdserve.prefill").start_span(
            "pdserve.prefill",
            context=extract_context(request.trace_context),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        try:
            if rid in self._aborted:
                raise PrefillAborted(f"request {rid} was aborted before its prefill started")
            with bind_request_id(rid), trace.use_span(span, end_on_exit=False):
                result, block_ids = await self._compute(runtime, request, span)
            if result.finished:  # the first token ended it: blocks freed, nothing to hand over
                yield result
                return
            try:
                yield result
                if rid in self._aborted:  # while the first token went out: push nothing
                    raise PrefillAborted(f"request {rid} was aborted before its KV push")
                with bind_request_id(rid), trace.use_span(span, end_on_exit=False):
                    src_blocks = [block_ids[i] for i in reservation.missing_block_indices]
                    await self._push(runtime, reservation, src_blocks, result)
            finally:  # also when the caller stopped listening after the first token
                await runtime.loop.acall(lambda: runtime.engine.release(rid))
            yield result
        finally:  # use_span recorded any exception of the work inside it
            span.end()

    async def _compute(
        self, runtime: WorkerRuntime, request: WorkRequest, span: Span
    ) -> tuple[PrefillResult, list[int]]:
        """Runs the prompt (prefill-only: its blocks stay held); returns the first token."""
        engine, rid = runtime.engine, request.request_id
        stream = runtime.loop.open_stream(rid)
        received = time.perf_counter()

        def add() -> bool:
            # On the engine thread, ordered with the abort's engine.abort: either the abort
            # is remembered here, or it finds the request in the engine and frees it.
            if rid in self._aborted:
                return False
            engine.add_request(rid, request.prompt_token_ids, request.sampling, prefill_only=True)
            runtime.track_queue(rid)
            return True

        if not await runtime.loop.acall(add):
            runtime.loop.close_stream(rid)
            raise PrefillAborted(f"request {rid} was aborted before its prefill started")
        try:
            output = await stream.get()
        finally:
            queue_s = runtime.queue_wait(rid)
        done = time.perf_counter()
        _child_span(span, "pdserve.prefill.queue", received, received + queue_s)
        if output is END_OF_STREAM:
            raise PrefillAborted(f"request {rid} was aborted during prefill")
        forward = {"pdserve.cached_tokens": output.num_cached_tokens}
        _child_span(span, "pdserve.prefill.forward", received + queue_s, done, forward)
        span.set_attributes(
            {"pdserve.cached_tokens": output.num_cached_tokens, "pdserve.queue_s": queue_s}
        )
        result = PrefillResult(
            request_id=rid,
            worker_id=self.worker_id,
            first_token_id=output.new_token_ids[0],
            first_logprob=output.new_logprobs[0] if output.new_logprobs else None,
            finished=output.finish_reason != "prefill",
            finish_reason=None if output.finish_reason == "prefill" else output.finish_reason,
            num_prompt_tokens=output.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens,
            queue_s=queue_s,
            prefill_s=done - received - queue_s,
        )
        return result, output.block_ids or []

    async def _push(
        self,
        runtime: WorkerRuntime,
        reservation: KVReservation,
        src_blocks: list[int],
        result: PrefillResult,
    ) -> None:
        """Pushes the held blocks the decode worker lacks and commits, in `pdserve.kv_transfer`;
        its context rides in every chunk header and the commit, so the decode side continues
        this trace."""
        from kv_transfer.base import CommitInfo

        attributes = {
            "pdserve.kv.transport": self._kv_config.transport,
            "pdserve.kv.blocks": len(src_blocks),
            "pdserve.kv.endpoint": reservation.endpoint,
            "pdserve.kv.decode_worker": reservation.decode_worker,
        }
        tracer = get_tracer("pdserve.prefill")
        with tracer.start_as_current_span(
            "pdserve.kv_transfer", kind=SpanKind.CLIENT, attributes=attributes
        ) as span:
            carrier = inject_context()
            commit = CommitInfo(
                first_token_id=result.first_token_id,
                first_logprob=result.first_logprob,
                num_prompt_tokens=result.num_prompt_tokens,
                trace_context=carrier,
            )
            push = self._handoff(runtime, reservation, src_blocks, commit, carrier)
            try:
                # Off the event loop: the push is blocking I/O; held blocks are safe to read.
                # to_thread copies the context, so the transport's own spans nest in this one.
                sent = await asyncio.to_thread(push)
            except Exception as exc:
                reason = metrics.transfer_failure_reason(exc)
                runtime.record_transfer(0, 0.0, failed=True, reason=reason)
                span.set_attributes({"pdserve.kv.outcome": "failed", "pdserve.kv.failure": reason})
                raise
            runtime.record_transfer(sent.bytes, sent.seconds)
            span.set_attributes(
                {
                    "pdserve.kv.outcome": "ok",
                    "pdserve.kv.bytes": sent.bytes,
                    "pdserve.kv.chunks": sent.chunks,
                    "pdserve.kv.seconds": sent.seconds,
                }
            )
            if sent.rank_bytes:  # a tensor-parallel handoff: what each prefill rank sent
                span.set_attribute("pdserve.kv.rank_bytes", list(sent.rank_bytes))
        result.transfer_s, result.transfer_bytes = sent.seconds, sent.bytes
        result.transfer_chunks = sent.chunks

    def _handoff(
        self,
        runtime: WorkerRuntime,
        reservation: KVReservation,
        src_blocks: list[int],
        commit: CommitInfo,
        carrier: dict[str, str],
    ) -> Callable[[], TransferResult]:
        """The blocking push and commit: one request on one device each side, else every
        prefill rank's heads to the decode ranks holding them, rank 0 committing."""
        from kv_transfer.base import TransferRequest
        from kv_transfer.tp_handoff import SlicedSend, send_sliced

        engine, group = runtime.engine, runtime.rank_group
        endpoints = reservation.rank_endpoints or [reservation.endpoint]
        if group is None and len(endpoints) == 1:
            request = TransferRequest(
                endpoint=reservation.endpoint,
                transfer_id=reservation.transfer_id,
                src_block_ids=src_blocks,
                num_layers=engine.num_layers,
                read_kv=engine.read_kv,
                commit=commit,
                trace_context=carrier,
            )
            return lambda: self._sender.send(request)
        send = SlicedSend(
            endpoints=tuple(endpoints),
            transfer_id=reservation.transfer_id,
            src_block_ids=src_blocks,
            num_layers=engine.num_layers,
            total_kv_heads=group.executor.kv_heads if group else engine.kv_cache.shape[-2],
            prefill_tp=group.tp.size if group else 1,
            trace_context=carrier,
        )

        def start_followers() -> Callable[[], list[TransferResult]]:
            if group is None:  # one prefill rank (the decode worker is tensor-parallel)
                return list  # no other rank's push to wait for: []
            return group.start_pushes(send)

        return lambda: send_sliced(self._sender, send, engine.kv_cache, commit, start_followers)

    async def inject_fault(self, kind: str) -> None:
        """Fault injection for tests and drills, enabled by WorkerConfig.fault_injection
        (`pdserve serve --fault-injection`).

        "corrupt_next_chunk": flips one payload byte of the next KV chunk after its checksum
        was computed, so the decode worker must reject it. "none": disarms.
        """
        if not self._spec.worker.fault_injection:
            raise PermissionError("fault injection is off (serve with --fault-injection)")
        if kind not in ("corrupt_next_chunk", "none"):
            raise ValueError(f"unknown fault {kind!r}")
        await self._started()
        if kind == "none":
            self._sender.tamper = None
            return
        armed = [True]

        def corrupt_once(seq: int, chunk):
            # gRPC hands over the encoded chunk (return the new bytes); the collective
            # transport hands over the gathered tensor copy (change it in place).
            if not armed[0]:
                return chunk
            armed[0] = False
            if isinstance(chunk, bytes):
                return chunk[:-1] + bytes([chunk[-1] ^ 0xFF])
            chunk.view(-1)[0] += 1.0
            return None

        self._sender.tamper = corrupt_once

    async def abort(self, request_id: str) -> None:
        """Frees the request's blocks at once and fences a prefill() not yet started (or not yet
        in the engine) for it. Idempotent."""
        self._aborted.add(request_id)  # before the first await: a racing prefill sees it
        runtime = await self._started()
        await runtime.abort(request_id)


def _child_span(
    parent: Span, name: str, start: float, end: float, attributes: dict | None = None
) -> None:
    """A finished child span of `parent` between two perf_counter readings."""
    if not parent.is_recording():
        return
    span = get_tracer("pdserve.prefill").start_span(
        name,
        context=trace.set_span_in_context(parent),
        start_time=wall_ns(start),
        attributes=attributes,
    )
    span.end(end_time=wall_ns(end))
