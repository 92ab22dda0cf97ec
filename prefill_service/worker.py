"""PrefillWorker: the Ray actor that computes prompts and pushes their KV to decode workers.

prefill() runs the prompt in prefill-only mode (the engine reuses this worker's prefix cache and
holds the blocks after sampling the first token), pushes the blocks the decode worker lacks
through the configured transport, commits with the first token, and releases the blocks — to
this worker's prefix cache, where a later request with the same prefix finds them. P never
holds blocks on D's behalf once its push is done, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.engine.engine_loop import END_OF_STREAM
from pdserve.messages import KVReservation, PrefillResult, WorkerStats, WorkRequest

if TYPE_CHECKING:  # torch; imported on the worker only, so the router can import this module
    from pdserve.engine.worker_runtime import WorkerRuntime

log = logging.getLogger(__name__)


class PrefillAborted(RuntimeError):
    """The request was aborted while it waited or computed on this worker."""


class PrefillWorker:
    def __init__(self, worker_id: str, engine_config: EngineConfig, kv_config: KVTransferConfig,
                 redis_url: str | None = None) -> None:
        self.worker_id = worker_id
        self._engine_config = engine_config
        self._kv_config = kv_config
        self._redis_url = redis_url
        self._runtime: WorkerRuntime | None = None
        self._sender = None
        self._start_lock = asyncio.Lock()

    async def _started(self) -> WorkerRuntime:
        # Lazy, on the actor's event loop: see DecodeWorker._started.
        async with self._start_lock:
            if self._runtime is None:
                from kv_transfer.factory import make_sender
                from pdserve.engine.worker_runtime import WorkerRuntime

                self._runtime = WorkerRuntime(self.worker_id, "prefill", self._engine_config,
                                              self._redis_url)
                self._sender = make_sender(self._kv_config)
        return self._runtime

    async def ready(self) -> dict:
        runtime = await self._started()
        return {"worker_id": self.worker_id, "epoch": runtime.epoch}

    async def prefill(self, request: WorkRequest, reservation: KVReservation) -> PrefillResult:
        """Computes the prompt, moves its KV to the reservation's decode worker and commits.

        Raises KVTransferError when the push or the commit fails (the caller retries),
        PrefillAborted when the request was aborted meanwhile.
        """
        from kv_transfer.base import CommitInfo, TransferRequest

        runtime = await self._started()
        engine = runtime.engine
        rid = request.request_id
        stream = runtime.loop.open_stream(rid)
        received = time.perf_counter()
        await runtime.loop.acall(lambda: engine.add_request(
            rid, request.prompt_token_ids, request.sampling, prefill_only=True))
        output = await stream.get()
        prefill_done = time.perf_counter()
        if output is END_OF_STREAM:
            raise PrefillAborted(f"request {rid} was aborted during prefill")
        result = PrefillResult(
            request_id=rid, worker_id=self.worker_id,
            first_token_id=output.new_token_ids[0],
            first_logprob=output.new_logprobs[0] if output.new_logprobs else None,
            text=output.text_delta, finished=output.finish_reason != "prefill",
            finish_reason=None if output.finish_reason == "prefill" else output.finish_reason,
            num_prompt_tokens=output.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens,
            queue_s=0.0, prefill_s=prefill_done - received,
        )
        if result.finished:  # the first token ended it: nothing to hand over, blocks are freed
            return result
        try:
            src_blocks = [output.block_ids[i] for i in reservation.missing_block_indices]
            commit = CommitInfo(first_token_id=result.first_token_id,
                                first_logprob=result.first_logprob,
                                num_prompt_tokens=result.num_prompt_tokens)
            transfer = TransferRequest(
                endpoint=reservation.endpoint, transfer_id=reservation.transfer_id,
                src_block_ids=src_blocks, num_layers=engine.num_layers,
                read_kv=engine.read_kv, commit=commit,
                trace_context=request.trace_context,
            )
            try:
                # Off the event loop: the push is blocking I/O; held blocks are safe to read.
                sent = await asyncio.to_thread(self._sender.send, transfer)
            except Exception:
                runtime.record_transfer(0, 0.0, failed=True)
                raise
            runtime.record_transfer(sent.bytes, sent.seconds)
            result.transfer_s, result.transfer_bytes = sent.seconds, sent.bytes
            result.transfer_chunks = sent.chunks
        finally:
            await runtime.loop.acall(lambda: engine.release(rid))
        return result

    async def inject_fault(self, kind: str) -> None:
        """Fault injection for tests and drills, enabled by PDSERVE_FAULT_INJECTION=1.

        "corrupt_next_chunk": flips one payload byte of the next KV chunk after its checksum
        was computed, so the decode worker must reject it. "none": disarms.
        """
        if os.environ.get("PDSERVE_FAULT_INJECTION") != "1":
            raise PermissionError("fault injection is off (set PDSERVE_FAULT_INJECTION=1)")
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
        runtime = await self._started()
        await runtime.abort(request_id)

    async def stats(self) -> WorkerStats:
        runtime = await self._started()
        return await runtime.stats()
