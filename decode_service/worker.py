"""DecodeWorker: the Ray actor that generates tokens, from KV it receives or computes itself.

Lifecycle of a disaggregated request here (docs/design.md, lifecycle (a)):
reserve() allocates the prompt's blocks (reusing this worker's prefix cache) and opens a
transfer on the KV receiver; the prefill worker pushes the missing blocks and commits with the
first token (KVSink.on_commit, on a receiver thread); the engine then decodes and stream()
hands the tokens to the router. A reservation that is not committed by its deadline is freed
by the receiver's reaper (on_expired). generate() is the local path: this worker prefills too.
On a tensor-parallel worker every rank receives its own heads on its own KV endpoint; this
actor (rank 0) opens, seals and aborts the other ranks' parts with its own
(kv_transfer/tp_handoff.py), over Ray calls that run off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from decode_service.handoffs import Handoff, HandoffTable
from decode_service.peer_pull_methods import PeerPullMethods
from pdserve.core.messages import KVReservation, TokenBatch, WorkRequest
from pdserve.logging_setup import bind_request_id
from pdserve.telemetry import extract_context, get_tracer, inject_context, span_from_carrier
from pdserve.worker.aborted_requests import AbortedRequests
from pdserve.worker.worker_actor import WorkerActor
from pdserve.worker.worker_spec import WorkerSpec

if TYPE_CHECKING:  # torch; imported on the worker only, so the router can import this module
    import torch

    from kv_transfer.base import CommitInfo
    from pdserve.worker.worker_runtime import WorkerRuntime

log = logging.getLogger(__name__)

# How long on_commit waits for the engine thread before failing the commit.
COMMIT_TIMEOUT_S = 30.0
# Recent requests whose received trace context trace_contexts() can report.
TRACE_CONTEXTS_KEPT = 1024


class DecodeWorker(PeerPullMethods, WorkerActor):
    role = "decode"

    def __init__(self, worker_id: str, spec: WorkerSpec) -> None:
        super().__init__(worker_id, spec)
        self._receiver = None
        self._sender = None  # pushes prefixes to pulling peers (push_prefix)
        self._endpoint = ""
        self._rank_endpoints: list[str] = []
        self._ranked = False  # a tensor-parallel worker: the receiver reaches its other ranks
        self._cache_received_kv = False
        self._handoffs = HandoffTable()
        # Aborts that may arrive before the reserve() or generate() they abort; read by the
        # engine thread too (in generate's `add`).
        self._aborted = AbortedRequests()
        self._streams: dict[str, asyncio.Queue] = {}
        # Received trace contexts of recent requests, oldest first (outlive their handoffs).
        self._trace_contexts: dict[str, dict[str, dict[str, str]]] = {}

    def _start_transport(self, runtime: WorkerRuntime) -> None:
        from kv_transfer.base import KVLayout
        from kv_transfer.factory import make_receiver
        from kv_transfer.tp_handoff import RankedReceiver

        self._aloop = asyncio.get_running_loop()
        kv_cache = runtime.engine.kv_cache
        layout = KVLayout.of(kv_cache)  # on a TP worker: rank 0's heads, the model's first
        group = runtime.rank_group
        if group:
            sink = RankedReceiver.sealing(self, group.call_followers)
            own = make_receiver(self._kv_config, sink, layout, kv_cache)
            self._receiver = RankedReceiver(own, group.call_followers, group.kv_endpoints())
            self._ranked = True
        else:
            self._receiver = make_receiver(self._kv_config, self, layout, kv_cache)
        self._endpoint = self._receiver.start()
        self._rank_endpoints = self._receiver.endpoints if group else [self._endpoint]
        self._cache_received_kv = self._kv_config.caches_received_kv

    def _ready_info(self) -> dict:
        return {"kv_endpoint": self._endpoint}

    # ---- router-facing ---------------------------------------------------------------------
    async def reserve(
        self, request: WorkRequest, reservation_timeout_s: float | None = None
    ) -> KVReservation | None:
        """Allocates the prompt's blocks and opens a transfer; None when there is no room now
        or the request was aborted meanwhile.

        The reservation is freed if no commit arrives within the timeout (default: config).
        """
        if request.request_id in self._aborted:  # the abort ran first: reserve nothing
            return None
        # Recorded before the first await, so an abort() arriving meanwhile finds and cancels it.
        handoff = self._handoffs.begin(
            request.request_id, len(request.prompt_token_ids), request.sampling.logprobs
        )
        try:
            return await self._reserve(handoff, request, reservation_timeout_s)
        except BaseException:
            self._handoffs.end(handoff)
            raise

    async def _reserve(
        self, handoff: Handoff, request: WorkRequest, reservation_timeout_s: float | None
    ) -> KVReservation | None:
        runtime = await self._started()
        rid = request.request_id
        self._remember_trace(rid, "ray", request.trace_context)
        attributes = {"pdserve.request_id": rid, "pdserve.worker_id": self.worker_id}
        with (
            bind_request_id(rid),
            span_from_carrier("pdserve.decode.reserve", request.trace_context, attributes) as span,
        ):
            engine = runtime.engine
            pull = handoff.pulled_blocks > 0
            reservation = await runtime.loop.acall(
                lambda: engine.reserve(rid, request.prompt_token_ids, request.sampling, pull=pull)
            )
            if reservation is None:
                span.set_attribute("pdserve.outcome", "no_room")
                self._handoffs.end(handoff)
                return None
            if handoff.cancelled:  # abort() ran while the engine reserved: undo, open nothing
                await runtime.loop.acall(lambda: engine.abort(rid))
                span.set_attribute("pdserve.outcome", "aborted")
                return None
            self._streams[rid] = runtime.loop.open_stream(rid)
            missing = reservation.missing_block_indices
            if pull:
                missing = [i for i in missing if i < handoff.pulled_blocks]
                if not missing:  # this worker holds what the peer does: nothing to pull
                    await runtime.loop.acall(lambda: engine.fall_back(rid))
                    self._handoffs.end(handoff)
                    span.set_attribute("pdserve.outcome", "nothing_to_pull")
                    return self._reservation("", [], reservation.num_cached_tokens, 0.0)
            dest_blocks = [reservation.block_ids[i] for i in missing]
            timeout = reservation_timeout_s or self._kv_config.reservation_timeout_s
            transfer_id = await self._on_receiver(
                self._receiver.open, dest_blocks, timeout, inject_context()
            )
            if handoff.cancelled:  # abort() ran while the ranks opened: it found no transfer
                await self._on_receiver(self._receiver.abort, transfer_id)
                span.set_attribute("pdserve.outcome", "aborted")
                return None
            handoff.reserve_span = span.get_span_context()
            self._handoffs.attach(handoff, transfer_id, len(dest_blocks))
            span.set_attributes(
                {
                    "pdserve.outcome": "ok",
                    "pdserve.cached_tokens": reservation.num_cached_tokens,
                    "pdserve.kv.blocks": len(dest_blocks),
                }
            )
        return self._reservation(transfer_id, missing, reservation.num_cached_tokens, timeout)

    def _reservation(
        self, transfer_id: str, missing: list[int], num_cached_tokens: int, timeout: float
    ) -> KVReservation:
        return KVReservation(
            decode_worker=self.worker_id,
            transfer_id=transfer_id,
            endpoint=self._endpoint,
            missing_block_indices=list(missing),
            num_cached_tokens=num_cached_tokens,
            deadline=time.time() + timeout,
            transport=self._kv_config.transport,
            rank_endpoints=self._rank_endpoints,
        )

    async def _on_receiver(self, call, *args):
        """A receiver call; on a tensor-parallel worker off the event loop, as it waits for
        Ray calls to the other ranks."""
        if self._ranked:
            return await asyncio.to_thread(call, *args)
        return call(*args)

    async def generate(self, request: WorkRequest) -> None:
        """Local path: prefill and decode here. Tokens come out of stream()."""
        runtime = await self._started()
        rid = request.request_id
        self._remember_trace(rid, "ray", request.trace_context)
        attributes = {
            "pdserve.request_id": rid,
            "pdserve.worker_id": self.worker_id,
            "pdserve.path": "local",
        }
        with (
            bind_request_id(rid),
            span_from_carrier("pdserve.decode.admit", request.trace_context, attributes),
        ):
            self._streams[rid] = runtime.loop.open_stream(rid)

            def add() -> bool:
                # On the engine thread, ordered with the abort's engine.abort: either the
                # abort is remembered here, or it finds the request in the engine and frees it.
                if rid in self._aborted:
                    return False
                runtime.engine.add_request(rid, request.prompt_token_ids, request.sampling)
                return True

            if not await runtime.loop.acall(add):  # stream() then ends as aborted
                self._streams.pop(rid, None)
                runtime.loop.close_stream(rid)

    async def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        """Token batches of a reserved-and-committed or locally prefilled request."""
        runtime = await self._started()
        stream = self._streams.pop(request_id, None)
        if stream is None:
            yield TokenBatch(request_id, [], [], "", finished=True, finish_reason="abort")
            return
        started = time.perf_counter()
        # Not the current span: this generator yields to Ray between batches.
        span = get_tracer("pdserve.decode").start_span(
            "pdserve.decode",
            context=extract_context(self._trace_contexts.get(request_id, {}).get("ray")),
            attributes={"pdserve.request_id": request_id, "pdserve.worker_id": self.worker_id},
        )
        first, tokens, finish_reason = True, 0, None
        drafted = accepted = 0  # speculative decoding's draft tokens verified, and accepted
        try:
            async for batch in runtime.batches(request_id, stream):
                if first:
                    batch.prefill_s, first = time.perf_counter() - started, False
                    span.add_event("pdserve.first_token")
                tokens += len(batch.token_ids)
                drafted += batch.num_draft_tokens
                accepted += batch.num_accepted_tokens
                finish_reason = batch.finish_reason
                yield batch
        finally:
            span.set_attributes(
                {
                    "pdserve.completion_tokens": tokens,
                    "pdserve.finish_reason": finish_reason or "",
                    "pdserve.spec.draft_tokens": drafted,
                    "pdserve.spec.accepted_tokens": accepted,
                }
            )
            span.end()

    async def abort(self, request_id: str) -> None:
        """Ends the request whatever its state: reservation, transfer, decoding; also one whose
        reserve() or generate() has not started yet. Idempotent."""
        self._aborted.add(request_id)  # before the first await: a racing call sees it
        runtime = await self._started()
        handoff = self._handoffs.cancel(request_id)
        if handoff is not None and handoff.transfer_id:
            await self._on_receiver(self._receiver.abort, handoff.transfer_id)
        self._streams.pop(request_id, None)
        await runtime.abort(request_id)

    async def trace_contexts(self) -> dict[str, dict[str, dict[str, str]]]:
        """The W3C trace contexts this worker received for its recent requests (by the
        router-made request id), by path: "ray" (the router's call) and "kv" (the prefill
        worker's chunks and commit). For debugging."""
        return dict(self._trace_contexts)

    def _remember_trace(self, request_id: str, path: str, context: dict[str, str]) -> None:
        self._trace_contexts.setdefault(request_id, {})[path] = dict(context)
        while len(self._trace_contexts) > TRACE_CONTEXTS_KEPT:
            self._trace_contexts.pop(next(iter(self._trace_contexts)))

    # ---- KVSink: called by the receiver on its own threads ---------------------------------
    def write_kv(
        self,
        transfer_id: str,
        block_ids: list[int],
        layer_start: int,
        data: torch.Tensor,
        head_start: int,
    ) -> None:
        handoff = self._handoffs.of_transfer(transfer_id)
        if handoff is not None and handoff.first_chunk_ns is None:
            handoff.first_chunk_ns = time.time_ns()
        self._runtime.engine.write_kv(block_ids, layer_start, data, head_start)

    def on_commit(self, transfer_id: str, commit: CommitInfo) -> None:
        handoff = self._handoffs.of_transfer(transfer_id)
        if handoff is None:
            raise KeyError(f"transfer {transfer_id!r} is not open on {self.worker_id}")
        handoff.check_commit(commit)
        request_id = handoff.request_id
        self._remember_trace(request_id, "kv", commit.trace_context)
        now = time.time_ns()
        tracer = get_tracer("pdserve.decode")
        # A child of the sender's kv_transfer span (the commit carries its context), linked to
        # this worker's reserve span: from its first chunk to its commit, the KV was arriving.
        receive = tracer.start_span(
            "pdserve.kv_receive",
            context=extract_context(commit.trace_context),
            kind=SpanKind.SERVER,
            start_time=handoff.first_chunk_ns or now,
            links=[Link(handoff.reserve_span)] if handoff.reserve_span else None,
            attributes={
                "pdserve.request_id": request_id,
                "pdserve.worker_id": self.worker_id,
                "pdserve.kv.blocks": handoff.blocks,
                "pdserve.kv.bytes": handoff.blocks * self._runtime.bytes_per_block,
                # How long the reservation waited for its KV (prefill compute included).
                "pdserve.kv.reserved_s": (now - handoff.reserved_ns) / 1e9,
            },
        )
        engine = self._runtime.engine
        with (
            bind_request_id(request_id),
            trace.use_span(receive, end_on_exit=True),
            tracer.start_as_current_span("pdserve.decode.admit", attributes={"pdserve.path": "kv"}),
        ):
            if handoff.pulled_blocks:
                pulled = handoff.pulled_blocks

                def admit() -> None:
                    engine.commit_prefix(request_id, pulled, self._cache_received_kv)

            else:

                def admit() -> None:
                    engine.commit(
                        request_id,
                        commit.first_token_id,
                        commit.first_logprob,
                        cache_blocks=self._cache_received_kv,
                    )

            self._runtime.loop.call(admit).result(COMMIT_TIMEOUT_S)
        self._handoffs.end(handoff)

    def on_expired(self, transfer_id: str) -> None:
        handoff = self._handoffs.of_transfer(transfer_id)
        if handoff is None:
            return
        request_id = handoff.request_id
        if handoff.pulled_blocks:  # the peer's blocks did not come: compute them here
            log.warning("pull of %s ended before commit; prefilling it here", request_id)
            self._handoffs.end(handoff)
            engine = self._runtime.engine
            self._runtime.loop.call(lambda: engine.fall_back(request_id))
            return
        log.warning("reservation of %s expired before commit; freeing its blocks", request_id)
        self._aloop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.abort(request_id)))
