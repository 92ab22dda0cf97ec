"""Decode side of the nixl transport: KV lands in the reserved blocks by a NIXL READ.

Each worker registers its whole KV cache with its NIXL agent once (the prefill side for reading,
`nixl_sender.py`). Per transfer, the sender's `PullKV` names its cache (agent metadata, address,
blocks per plane) and the source block of each reserved block; the receiver validates it against
the reservation like a grpc chunk, then, inside the ReservationTable's write of the transfer
(under the transfer's lock), READs straight from the prefill cache's blocks into the reserved
blocks — no staging buffer, no copy. Blocks consecutive on both sides travel as one descriptor
per (layer, K|V) plane. A tensor-parallel rank's part (kv_transfer/tp_handoff.py) names its
heads: the header's `kv_head_start` and shape (which of this cache's heads it fills),
`src_num_heads` / `src_head_start` (where they lie in the source's); where either cache holds
more heads than the part, the READ takes one descriptor per (layer, K|V, block, position).
The READ goes a layer range at a time (the grpc chunking, at least 64 MiB), two in flight:
while one lands, the CRC-32C of the one before runs on another thread, so the checksum costs
little beyond the READ where a core is free. The reply carries the checksum of what landed; the
sender commits only if it equals its own. Waits end at the reservation's deadline. Commit and
Abort are the grpc transport's.

Why the decode side reads rather than the prefill side writing: the reader owns the operation
that touches the reserved blocks, so a fence is real — `abort` (own or remote) cancels the READ
and returns only once it stopped, and the deadline ends it — and the decode worker's cache is
never writable by a peer. A written-into cache could not stop a peer's late WRITE landing in
blocks already freed and reused: not even deregistering them stops it over UCX TCP or shared
memory (`tests/kv_transfer/test_nixl_fence.py`). vLLM's NixlConnector pulls in the same
direction.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from kv_transfer.base import CommitInfo, KVLayout, KVSink
from kv_transfer.grpc_common import STATUS_OF
from kv_transfer.grpc_receiver import GrpcKVReceiver, spec_of
from kv_transfer.grpc_sender import layer_ranges
from kv_transfer.nixl_agent import (
    block_runs,
    drive,
    make_agent,
    memory_type,
    position_regions,
    regions_checksum,
    run_regions,
)
from kv_transfer.reservations import RejectReason, TransferRejected
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

_CANCEL_GRACE_S = 1.0  # how long a cancelled READ may take to stop before we give up on it
_MEMORY_TYPES = ("DRAM", "VRAM")
_IN_FLIGHT = 2  # layer ranges being read at once: one lands while the next is on its way
# A READ moves at least this much (whole layers), whatever the grpc chunk size: nothing is
# staged, so a range costs no memory, and fewer, larger READs cost UCX's emulated GET over TCP
# less per byte. Measured on 2 cores, 256 MiB, quiet (BENCHMARKS.md, issue 18): nixl/raw TCP
# 0.68-0.72 with 4 MiB ranges, 0.79 / 0.78-0.80 / 0.81 with 32 / 64 / 128 MiB.
_MIN_RANGE_BYTES = 64 << 20


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
        self.checksum = 0
        self.descriptors = 0  # of the READ, each side

    def run(self, block_ids: list[int], head_start: int) -> None:
        """READs into heads [head_start, head_start + the header's count) (the cache's own
        indices) of `block_ids`."""
        receiver, tid = self.receiver, self.request.header.transfer_id
        local_rows, remote_rows, per_layer = self._regions(block_ids, head_start)
        self.descriptors = len(local_rows)
        layer_bytes = int(local_rows[:per_layer, 1].sum())
        range_bytes = max(receiver.config.chunk_bytes, _MIN_RANGE_BYTES)
        ranges = layer_ranges(receiver.cache.shape[0], layer_bytes, range_bytes)
        peer = self._peer(tid)
        posted: list[Any] = []  # READ handles of the layer ranges, in order
        checksum = _Checksum(receiver)
        try:
            for index, (l0, l1) in enumerate(ranges):
                while len(posted) < min(index + _IN_FLIGHT, len(ranges)):
                    first, last = ranges[len(posted)]
                    rows = slice(first * per_layer, last * per_layer)
                    posted.append(self._post(peer, local_rows[rows], remote_rows[rows], tid))
                self._wait(posted[index], tid)
                checksum.add(local_rows[l0 * per_layer : l1 * per_layer])
        finally:
            for handle in posted:
                self._release(handle, tid)
        self.nbytes = int(local_rows[:, 1].sum())
        self.checksum = checksum.result()

    def _regions(self, block_ids: list[int], head_start: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(local rows, remote rows, rows per layer): the descriptors of every layer, layer-major,
        one per (plane, run of blocks consecutive on both sides) where both caches hold exactly
        the heads moved, else one per (plane, block, position) (a tensor-parallel part)."""
        cache, request = self.receiver.cache, self.request
        src, src_blocks = self._source(len(block_ids))
        count = request.header.shape[4]
        src_heads = self._source_heads(count)
        planes = range(2 * cache.shape[0])
        if not count == cache.shape[4] == src_heads:
            return self._position_regions(
                block_ids, src, src_blocks, src_heads, planes, (head_start, count)
            )
        dest_starts, src_starts, lengths = block_runs(block_ids, src)
        block_bytes = cache[0, 0, 0].nbytes
        local = run_regions(
            cache.data_ptr(), memory_type(cache)[1], cache.shape[2], planes, dest_starts, lengths,
            block_bytes,
        )  # fmt: skip
        remote = run_regions(
            request.address, request.device_id, src_blocks, planes, src_starts, lengths,
            block_bytes,
        )  # fmt: skip
        return local, remote, 2 * len(lengths)

    def _position_regions(
        self,
        block_ids: list[int],
        src: list[int],
        src_blocks: int,
        src_heads: int,
        planes: range,
        heads: tuple[int, int],
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """`heads`: (first head in this cache, count) the part fills."""
        cache, request = self.receiver.cache, self.request
        head_start, count = heads
        head_bytes, block_size = cache[0, 0, 0, 0, 0].nbytes, cache.shape[3]
        local = position_regions(
            cache.data_ptr(), memory_type(cache)[1], cache.shape[2], planes,
            np.asarray(block_ids, dtype=np.int64), block_size, cache.shape[4] * head_bytes,
            (head_start, head_start + count), head_bytes,
        )  # fmt: skip
        first = request.src_head_start
        remote = position_regions(
            request.address, request.device_id, src_blocks, planes,
            np.asarray(src, dtype=np.int64), block_size, src_heads * head_bytes,
            (first, first + count), head_bytes,
        )  # fmt: skip
        return local, remote, 2 * len(block_ids) * block_size

    def _source_heads(self, count: int) -> int:
        """KV heads per position of the source cache; checks the heads read lie within it."""
        request, tid = self.request, self.request.header.transfer_id
        src_heads = request.src_num_heads or count
        if request.src_head_start + count > src_heads:
            raise PullFailed(
                RejectReason.INVALID,
                f"transfer {tid}: src_head_start {request.src_head_start} + {count} heads is "
                f"beyond src_num_heads {src_heads}",
            )
        return src_heads

    def _source(self, n: int) -> tuple[list[int], int]:
        """The source block of each reserved block, and the blocks per plane of the source."""
        request, tid = self.request, self.request.header.transfer_id
        if request.memory not in _MEMORY_TYPES:
            raise PullFailed(
                RejectReason.INVALID, f"transfer {tid}: memory {request.memory!r} is not DRAM/VRAM"
            )
        if not request.src_block_ids:  # one tensor of exactly the reserved blocks
            return list(range(n)), n
        src = list(request.src_block_ids)
        if len(src) != n:
            raise PullFailed(
                RejectReason.INVALID,
                f"transfer {tid}: src_block_ids names {len(src)} blocks for {n} reserved",
            )
        if max(src) >= request.src_num_blocks:
            raise PullFailed(
                RejectReason.INVALID,
                f"transfer {tid}: src_block_ids has block {max(src)}, outside "
                f"src_num_blocks {request.src_num_blocks}",
            )
        return src, request.src_num_blocks

    def _peer(self, tid: str) -> str:
        try:
            return self.receiver.agent.add_remote_agent(self.request.agent_metadata)
        except Exception as exc:  # NIXL refuses metadata it cannot parse
            raise PullFailed(
                RejectReason.INVALID, f"transfer {tid}: agent_metadata unusable: {exc}"
            ) from None

    def _post(self, peer: str, local: np.ndarray, remote: np.ndarray, tid: str) -> Any:
        agent = self.receiver.agent
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, memory_type(self.receiver.cache)[0]),
                agent.get_xfer_descs(remote, self.request.memory),
                peer,
            )
        except Exception as exc:  # regions outside what the peer registered
            raise PullFailed(
                RejectReason.INVALID,
                f"transfer {tid}: agent_metadata/address/src_block_ids unusable: {exc}",
            ) from None
        state = agent.transfer(handle)
        if state not in ("PROC", "DONE"):
            self._release(handle, tid)
            raise PullFailed(RejectReason.INVALID, f"transfer {tid}: the READ failed ({state})")
        return handle

    def _wait(self, handle: Any, tid: str) -> None:
        agent = self.receiver.agent
        state = ["PROC"]

        def done() -> bool:
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


class _Checksum:
    """The running checksum of landed regions. On CPU each layer range's CRC-32C runs on the
    receiver's checksum thread (one for all pulls, so ranges are taken in order) while the next
    range is read; on CUDA the device checksum of all regions is taken at the end."""

    def __init__(self, receiver: NixlKVReceiver) -> None:
        self.cache = receiver.cache
        self.pipelined = self.cache.device.type == "cpu"
        self._executor = receiver.checksum_thread
        self._value = 0
        self._last: Future[None] | None = None
        self._rows: list[np.ndarray] = []

    def add(self, rows: np.ndarray) -> None:
        if not self.pipelined:
            self._rows.append(rows)
            return
        self._last = self._executor.submit(self._extend, rows)

    def _extend(self, rows: np.ndarray) -> None:
        self._value = regions_checksum(self.cache, rows, self._value)

    def result(self) -> int:
        if not self.pipelined:
            return regions_checksum(self.cache, np.concatenate(self._rows)) if self._rows else 0
        if self._last is not None:
            self._last.result()
        return self._value


class _DirectSink:
    """The sink the ReservationTable writes through: a `_Pull` READs into the blocks itself,
    anything else (a grpc chunk on the same endpoint) goes to the decode worker's sink."""

    def __init__(self, sink: KVSink) -> None:
        self.sink = sink

    def write_kv(
        self, transfer_id: str, block_ids: list[int], layer_start: int, data: Any, head_start: int
    ) -> None:
        if isinstance(data, _Pull):
            data.run(block_ids, head_start)
        else:
            self.sink.write_kv(transfer_id, block_ids, layer_start, data, head_start)

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
        # CRC-32C of landed layer ranges while the next ones are read (crc32c frees the GIL)
        self.checksum_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nixl-crc")
        self._registration: Any = None
        # transfer id -> "stop its READ", for transfers being pulled or aborted
        self._cancels: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def start(self) -> str:
        self.agent = make_agent("decode", self.config.nixl_ucx_tls, self.config.bind_host)
        self._registration = self.agent.register_memory(self.cache)
        return super().start()

    def stop(self) -> None:
        super().stop()
        if self._registration is not None:
            with contextlib.suppress(Exception):  # shutting down: nothing to recover
                self.agent.deregister_memory(self._registration)
            self._registration = None
        self.checksum_thread.shutdown(wait=False)

    def abort(self, transfer_id: str) -> bool:
        with self._cancelling(transfer_id):
            return super().abort(transfer_id)

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
            pull = self._pull(request)
            return pb.PullKVResponse(
                bytes=pull.nbytes, checksum=pull.checksum, descriptors=pull.descriptors
            )
        except TransferRejected as exc:
            context.abort(STATUS_OF[exc.reason], str(exc))

    def _pull(self, request: pb.PullKVRequest) -> _Pull:
        """READs the transfer's KV into its blocks; returns the finished pull (bytes read and
        the checksum of what landed)."""
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
        return pull

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
