"""Decode side of the nixl transport: KV lands in the reserved blocks by a NIXL READ.

The decode worker registers its whole KV cache with its NIXL agent once. Per transfer, the
sender's `PullKV` names where its gathered KV lies (its agent metadata, the address, the
checksum); the receiver validates it against the reservation like a grpc chunk, then, inside
the ReservationTable's write of the transfer (under the transfer's lock), READs every
(layer, K|V, block) region straight into the reserved blocks — no staging buffer, no copy —
waits for it no longer than the reservation's deadline, and checks the CRC-32C of the landed
bytes. Commit and Abort are the grpc transport's.

Why the decode side reads rather than the prefill side writing: the reader owns the operation
that touches the reserved blocks, so a fence is real — `abort` (own or remote) cancels the READ
and returns only once it stopped, and the deadline ends it — and the decode worker's cache is
never writable by a peer. A written-into cache could not stop a peer's late WRITE landing in
blocks already freed and reused. vLLM's NixlConnector pulls in the same direction.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import crc32c
import grpc
import numpy as np

from kv_transfer import wire
from kv_transfer.base import CommitInfo, KVLayout, KVSink
from kv_transfer.grpc_common import STATUS_OF
from kv_transfer.grpc_receiver import GrpcKVReceiver, spec_of
from kv_transfer.nixl_agent import block_regions, drive, make_agent, memory_type
from kv_transfer.reservations import RejectReason, TransferRejected
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

_CANCEL_GRACE_S = 1.0  # how long a cancelled READ may take to stop before we give up on it
_MEMORY_TYPES = ("DRAM", "VRAM")


class PullFailed(Exception):
    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Pull:
    """One PullKV's READ; run by `_DirectSink.write_kv` under the transfer's lock."""

    def __init__(
        self,
        receiver: NixlKVReceiver,
        request: pb.PullKVRequest,
        deadline: float,
        cancel: threading.Event,
    ) -> None:
        self.receiver, self.request, self.deadline = receiver, request, deadline
        self.cancel = cancel  # set by an abort of the transfer
        self.nbytes = 0

    def run(self, block_ids: list[int]) -> None:
        receiver, request = self.receiver, self.request
        agent, cache = receiver.agent, receiver.cache
        tid = request.header.transfer_id
        if request.memory not in _MEMORY_TYPES:
            raise PullFailed(
                RejectReason.INVALID, f"transfer {tid}: memory {request.memory!r} is not DRAM/VRAM"
            )
        block_bytes = cache[0, 0, 0].nbytes
        planes, blocks = 2 * cache.shape[0], np.asarray(block_ids, dtype=np.uint64)
        local_mem, local_dev = memory_type(cache)
        local_rows = block_regions(
            cache.data_ptr(), local_dev, planes, cache.shape[2], blocks, block_bytes
        )
        source = np.arange(len(block_ids), dtype=np.uint64)
        remote_rows = block_regions(
            request.address, request.device_id, planes, len(block_ids), source, block_bytes
        )
        try:
            peer = agent.add_remote_agent(request.agent_metadata)
            local = agent.get_xfer_descs(local_rows, local_mem)
            remote = agent.get_xfer_descs(remote_rows, request.memory)
            handle = agent.initialize_xfer("READ", local, remote, peer)
        except Exception as exc:  # NIXL refuses metadata or regions it cannot map
            raise PullFailed(
                RejectReason.INVALID, f"transfer {tid}: agent_metadata/address unusable: {exc}"
            ) from None
        try:
            self._wait(agent, handle, tid)
        finally:
            self._release(handle, tid)
        self.nbytes = int(local_rows[:, 1].sum())
        if receiver.landed_checksum(local_rows) != request.header.checksum:
            raise PullFailed(RejectReason.CORRUPT, f"transfer {tid}: checksum mismatch")

    def _wait(self, agent: Any, handle: Any, tid: str) -> None:
        state = [agent.transfer(handle)]

        def done() -> bool:
            if state[0] == "PROC":
                state[0] = agent.check_xfer_state(handle)
            return state[0] != "PROC"

        drive(agent, done, lambda: self.cancel.is_set() or time.monotonic() >= self.deadline)
        if self.cancel.is_set():
            raise PullFailed(RejectReason.NOT_OPEN, f"transfer {tid} was aborted")
        if state[0] == "PROC":
            raise PullFailed(RejectReason.NOT_OPEN, f"transfer {tid}: READ past the deadline")
        if state[0] != "DONE":
            raise PullFailed(RejectReason.INVALID, f"transfer {tid}: the READ failed ({state[0]})")

    def _release(self, handle: Any, tid: str) -> None:
        """Frees the request; one still in flight is cancelled first, and we wait (briefly) until
        it stopped, so nothing lands in the blocks once the transfer's lock is released."""
        stop_by = time.monotonic() + _CANCEL_GRACE_S
        while True:
            try:
                handle.release()
                return
            except Exception:  # NIXL could not cancel it yet
                if time.monotonic() >= stop_by:
                    log.error("transfer %s: a cancelled NIXL READ did not stop", tid)
                    return
                time.sleep(0.01)


class _DirectSink:
    """The sink the ReservationTable writes through: a `_Pull` READs into the blocks itself,
    anything else (a grpc chunk on the same endpoint) goes to the decode worker's sink."""

    def __init__(self, sink: KVSink) -> None:
        self.sink = sink

    def write_kv(self, transfer_id: str, block_ids: list[int], layer_start: int, data: Any) -> None:
        if isinstance(data, _Pull):
            data.run(block_ids)
        else:
            self.sink.write_kv(transfer_id, block_ids, layer_start, data)

    def on_commit(self, transfer_id: str, commit: CommitInfo) -> None:
        self.sink.on_commit(transfer_id, commit)

    def on_expired(self, transfer_id: str) -> None:
        self.sink.on_expired(transfer_id)


class NixlKVReceiver(GrpcKVReceiver):
    """`kv_cache` is the engine's cache: NIXL reads into it directly."""

    def __init__(
        self,
        config: KVTransferConfig,
        sink: KVSink,
        layout: KVLayout | None = None,
        *,
        kv_cache: Any = None,
    ) -> None:
        if kv_cache is None or not kv_cache.is_contiguous() or kv_cache.dim() != 6:
            raise ValueError(
                "the nixl transport reads into the KV cache itself: pass kv_cache, the engine's "
                "contiguous [layers, 2, blocks, block_size, heads, head_dim] tensor"
            )
        super().__init__(config, _DirectSink(sink), layout or KVLayout.of(kv_cache))
        self.cache = kv_cache
        self.agent: Any = None
        self._registration: Any = None
        # transfer id -> "stop its READ", for transfers being pulled or aborted
        self._cancels: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def start(self) -> str:
        self.agent = make_agent("decode", self.config.nixl_ucx_tls)
        self._registration = self.agent.register_memory(self.cache)
        return super().start()

    def stop(self) -> None:
        super().stop()
        if self._registration is not None:
            with contextlib.suppress(Exception):  # shutting down: nothing to recover
                self.agent.deregister_memory(self._registration)
            self._registration = None

    def abort(self, transfer_id: str) -> bool:
        with self._cancelling(transfer_id):
            return super().abort(transfer_id)

    def landed_checksum(self, rows: np.ndarray) -> int:
        """Checksum of the regions `rows` of the cache, in order: what the sender computed over
        its contiguous tensor (CRC-32C on CPU, wire's device checksum on CUDA)."""
        if self.cache.device.type != "cpu":
            return wire.checksum(self._gather(rows))
        cache_bytes = wire.tensor_bytes(self.cache)
        base, value = self.cache.data_ptr(), 0
        for address, length, _ in rows.tolist():
            offset = address - base
            value = crc32c.crc32c(cache_bytes[offset : offset + length], value)
        return value

    def _gather(self, rows: np.ndarray) -> Any:
        import torch

        flat = self.cache.reshape(-1).view(torch.uint8)
        offsets = (rows[:, 0] - np.uint64(self.cache.data_ptr())).astype(np.int64).tolist()
        length = int(rows[0, 1])
        return torch.cat([flat[o : o + length] for o in offsets])

    # -- RPC handlers -----------------------------------------------------------------------

    def _handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        handlers = super()._handlers()
        handlers["PullKV"] = grpc.unary_unary_rpc_method_handler(
            self._pull_kv,
            request_deserializer=pb.PullKVRequest.FromString,
            response_serializer=pb.PullKVResponse.SerializeToString,
        )
        return handlers

    def _pull_kv(self, request: pb.PullKVRequest, context: grpc.ServicerContext) -> Any:
        try:
            return pb.PullKVResponse(bytes=self._pull(request))
        except TransferRejected as exc:
            context.abort(STATUS_OF[exc.reason], str(exc))

    def _pull(self, request: pb.PullKVRequest) -> int:
        """READs the transfer's KV into its blocks; returns the bytes read."""
        tid, spec = request.header.transfer_id, spec_of(request.header)
        self._table.validate(tid, spec)  # transfer open, dtype, shape = the reserved blocks
        if (spec.layer_start, spec.layer_end) != (0, spec.num_layers):
            self._table.fail(
                tid, f"transfer {tid}: PullKV must carry every layer", RejectReason.INVALID
            )
        with self._lock:  # an abort that already began has set it
            cancel = self._cancels.setdefault(tid, threading.Event())
        pull = _Pull(self, request, self._table.deadline(tid) or time.monotonic(), cancel)
        try:
            self._table.write(tid, spec, pull)
        except PullFailed as exc:
            if pull.cancel.is_set():  # the aborting call ends the transfer (and the callbacks)
                raise TransferRejected(RejectReason.NOT_OPEN, str(exc)) from None
            self._table.fail(tid, str(exc), exc.reason)
        finally:
            with self._lock:
                self._cancels.pop(tid, None)
        return pull.nbytes

    def _abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> Any:
        with self._cancelling(request.transfer_id):
            return super()._abort(request, context)

    @contextlib.contextmanager
    def _cancelling(self, transfer_id: str) -> Iterator[None]:
        """Stops the transfer's READ (running or about to start) while the abort runs; the
        abort then takes the transfer's lock once the READ let go of it."""
        with self._lock:
            self._cancels.setdefault(transfer_id, threading.Event()).set()
        try:
            yield
        finally:
            with self._lock:
                self._cancels.pop(transfer_id, None)
