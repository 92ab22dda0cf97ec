"""DecodeWorker: the Ray actor that generates tokens, from KV it receives or computes itself.

Lifecycle of a disaggregated request here (DESIGN.md, "Disaggregated request lifecycle"):
reserve() allocates the prompt's blocks (reusing this worker's prefix cache) and opens a
transfer on the KV receiver; the prefill worker pushes the missing blocks and commits with the
first token (KVSink.on_commit, on a receiver thread); the engine then decodes and stream()
hands the tokens to the router. A reservation that is not committed by its deadline is freed
by the receiver's reaper (on_expired). generate() is the local path: this worker prefills too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NamedTuple

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.core.messages import KVReservation, TokenBatch, WorkRequest
from pdserve.logging_setup import bind_request_id
from pdserve.telemetry import extract_context, get_tracer, inject_context, span_from_carrier
from pdserve.worker.worker_actor import WorkerActor

if TYPE_CHECKING:  # torch; imported on the worker only, so the router can import this module
    from pdserve.worker.worker_runtime import WorkerRuntime

log = logging.getLogger(__name__)

# How long on_commit waits for the engine thread before failing the commit.
COMMIT_TIMEOUT_S = 30.0
# Recent requests whose received trace context trace_contexts() can report.
TRACE_CONTEXTS_KEPT = 1024


class _OpenTransfer(NamedTuple):
    reserved_ns: int
    blocks: int  # blocks the prefill worker sends
    first_block: int | None
    reserve_span: trace.SpanContext


class DecodeWorker(WorkerActor):
    role = "decode"

    def __init__(
        self,
        worker_id: str,
        engine_config: EngineConfig,
        kv_config: KVTransferConfig,
        redis_url: str | None = None,
    ) -> None:
        super().__init__(worker_id, engine_config, kv_config, redis_url)
        self._receiver = None
        self._endpoint = ""
        self._request_of_transfer: dict[str, str] = {}
        self._transfer_of_request: dict[str, str] = {}
        self._streams: dict[str, asyncio.Queue] = {}
        self._trace_contexts: dict[str, dict[str, dict[str, str]]] = {}  # oldest first
        # What the kv_receive span of an open transfer needs when its commit arrives.
        self._opened: dict[str, _OpenTransfer] = {}
        # First destination block of an open transfer -> its id, until its first chunk lands;
        # then transfer_id -> that time (ns): where kv_receive starts.
        self._awaiting_first_chunk: dict[int, str] = {}
        self._first_chunk_ns: dict[str, int] = {}

    def _start_transport(self, runtime: WorkerRuntime) -> None:
        from kv_transfer.base import KVLayout
        from kv_transfer.factory import make_receiver

        self._aloop = asyncio.get_running_loop()
        self._receiver = make_receiver(self._kv_config, self, KVLayout.of(runtime.engine.kv_cache))
        self._endpoint = self._receiver.start()

    def _ready_info(self) -> dict:
        return {"kv_endpoint": self._endpoint}

    # ---- router-facing ---------------------------------------------------------------------
    async def reserve(
        self, request: WorkRequest, reservation_timeout_s: float | None = None
    ) -> KVReservation | None:
        """Allocates the prompt's blocks and opens a transfer; None when there is no room now.

        The reservation is freed if no commit arrives within the timeout (default: config).
        """
        runtime = await self._started()
        rid = request.request_id
        self._remember_trace(rid, "ray", request.trace_context)
        attributes = {"pdserve.request_id": rid, "pdserve.worker_id": self.worker_id}
        with (
            bind_request_id(rid),
            span_from_carrier("pdserve.decode.reserve", request.trace_context, attributes) as span,
        ):
            engine = runtime.engine
            reservation = await runtime.loop.acall(
                lambda: engine.reserve(rid, request.prompt_token_ids, request.sampling)
            )
            if reservation is None:
                span.set_attribute("pdserve.outcome", "no_room")
                return None
            self._streams[rid] = runtime.loop.open_stream(rid)
            dest_blocks = [reservation.block_ids[i] for i in reservation.missing_block_indices]
            timeout = reservation_timeout_s or self._kv_config.reservation_timeout_s
            transfer_id = self._receiver.open(dest_blocks, timeout, inject_context())
            self._request_of_transfer[transfer_id] = rid
            self._transfer_of_request[rid] = transfer_id
            first_block = dest_blocks[0] if dest_blocks else None
            self._opened[transfer_id] = _OpenTransfer(
                time.time_ns(), len(dest_blocks), first_block, span.get_span_context()
            )
            if first_block is not None:
                self._awaiting_first_chunk[first_block] = transfer_id
            span.set_attributes(
                {
                    "pdserve.outcome": "ok",
                    "pdserve.cached_tokens": reservation.num_cached_tokens,
                    "pdserve.kv.blocks": len(dest_blocks),
                }
            )
        return KVReservation(
            decode_worker=self.worker_id,
            transfer_id=transfer_id,
            endpoint=self._endpoint,
            missing_block_indices=list(reservation.missing_block_indices),
            num_cached_tokens=reservation.num_cached_tokens,
            deadline=time.time() + timeout,
            transport=self._kv_config.transport,
        )

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
            await runtime.loop.acall(
                lambda: runtime.engine.add_request(rid, request.prompt_token_ids, request.sampling)
            )

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
        try:
            async for batch in runtime.batches(request_id, stream):
                if first:
                    batch.prefill_s, first = time.perf_counter() - started, False
                    span.add_event("pdserve.first_token")
                tokens += len(batch.token_ids)
                finish_reason = batch.finish_reason
                yield batch
        finally:
            span.set_attributes(
                {"pdserve.completion_tokens": tokens, "pdserve.finish_reason": finish_reason or ""}
            )
            span.end()
        self._forget_transfer(request_id)

    async def abort(self, request_id: str) -> None:
        """Ends the request whatever its state: reservation, transfer, decoding. Idempotent."""
        runtime = await self._started()
        transfer_id = self._forget_transfer(request_id)
        if transfer_id is not None:
            self._receiver.abort(transfer_id)
        self._streams.pop(request_id, None)
        await runtime.abort(request_id)

    async def trace_contexts(self, request_id: str) -> dict[str, dict[str, str]]:
        """The W3C trace context this worker received for a request, by path: "ray" (the
        router's call) and "kv" (the prefill worker's chunks and commit). For debugging."""
        return self._trace_contexts.get(request_id, {})

    def _remember_trace(self, request_id: str, path: str, context: dict[str, str]) -> None:
        self._trace_contexts.setdefault(request_id, {})[path] = dict(context)
        while len(self._trace_contexts) > TRACE_CONTEXTS_KEPT:
            self._trace_contexts.pop(next(iter(self._trace_contexts)))

    def _forget_transfer(self, request_id: str) -> str | None:
        transfer_id = self._transfer_of_request.pop(request_id, None)
        if transfer_id is not None:
            self._request_of_transfer.pop(transfer_id, None)
            self._forget_opened(transfer_id)
        return transfer_id

    def _forget_opened(self, transfer_id: str) -> tuple[_OpenTransfer | None, int | None]:
        """What was kept for the transfer's kv_receive span, and when its first chunk landed."""
        opened = self._opened.pop(transfer_id, None)
        # Blocks are reused: only drop the entry if it is still this transfer's.
        if opened and self._awaiting_first_chunk.get(opened.first_block) == transfer_id:
            self._awaiting_first_chunk.pop(opened.first_block, None)
        return opened, self._first_chunk_ns.pop(transfer_id, None)

    # ---- KVSink: called by the receiver on its own threads ---------------------------------
    def write_kv(self, block_ids: list[int], layer_start: int, data) -> None:
        # Chunks carry no transfer id here; a transfer's chunks start at its first block.
        transfer_id = self._awaiting_first_chunk.pop(block_ids[0], None) if block_ids else None
        if transfer_id is not None:
            self._first_chunk_ns[transfer_id] = time.time_ns()
        self._runtime.engine.write_kv(block_ids, layer_start, data)

    def on_commit(self, transfer_id: str, commit) -> None:
        request_id = self._request_of_transfer.get(transfer_id)
        if request_id is None:
            raise KeyError(f"transfer {transfer_id!r} is not open on {self.worker_id}")
        self._remember_trace(request_id, "kv", commit.trace_context)
        opened, first_chunk_ns = self._forget_opened(transfer_id)
        now, blocks = time.time_ns(), opened.blocks if opened else 0
        tracer = get_tracer("pdserve.decode")
        # A child of the sender's kv_transfer span (the commit carries its context), linked to
        # this worker's reserve span: from its first chunk to its commit, the KV was arriving.
        receive = tracer.start_span(
            "pdserve.kv_receive",
            context=extract_context(commit.trace_context),
            kind=SpanKind.SERVER,
            start_time=first_chunk_ns or now,
            links=[Link(opened.reserve_span)] if opened else None,
            attributes={
                "pdserve.request_id": request_id,
                "pdserve.worker_id": self.worker_id,
                "pdserve.kv.blocks": blocks,
                "pdserve.kv.bytes": blocks * self._runtime.bytes_per_block,
                # How long the reservation waited for its KV (prefill compute included).
                "pdserve.kv.reserved_s": (now - opened.reserved_ns) / 1e9 if opened else 0.0,
            },
        )
        engine = self._runtime.engine
        with (
            bind_request_id(request_id),
            trace.use_span(receive, end_on_exit=True),
            tracer.start_as_current_span("pdserve.decode.admit", attributes={"pdserve.path": "kv"}),
        ):
            self._runtime.loop.call(
                lambda: engine.commit(request_id, commit.first_token_id, commit.first_logprob)
            ).result(COMMIT_TIMEOUT_S)

    def on_expired(self, transfer_id: str) -> None:
        request_id = self._request_of_transfer.get(transfer_id)
        self._forget_opened(transfer_id)
        if request_id is None:
            return
        log.warning("reservation of %s expired before commit; freeing its blocks", request_id)
        self._aloop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.abort(request_id)))
