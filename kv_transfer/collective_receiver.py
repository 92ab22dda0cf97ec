"""Decode side of the collective transport: payloads over torch.distributed, control over gRPC.

Per chunk: the sender's `PrepareChunk(header)` is validated against the reservation, the
matching `recv` is posted into a fresh buffer on the cache's device, and a waiter thread waits
for it no longer than the reservation's deadline (a dead or stuck sender cannot hold anything
past it), verifies the checksum, and writes through the same ReservationTable as grpc —
so reservations, fencing, commit and abort behave exactly as in the grpc transport.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time
from concurrent import futures
from typing import Any

import grpc

from kv_transfer import wire
from kv_transfer.base import KVLayout, KVSink
from kv_transfer.collective_group import PairGroup, backend_for, form_group
from kv_transfer.grpc_common import STATUS_OF
from kv_transfer.grpc_receiver import GrpcKVReceiver, spec_of
from kv_transfer.rendezvous import pair_store, serve_rendezvous
from kv_transfer.reservations import RejectReason, TransferRejected
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb

# Chunks of one pair (one sender) verified concurrently. Each pair has its own threads: a
# sender frozen mid-transfer holds a waiter per chunk it announced until that transfer's
# deadline, and with one pool for every sender those waits held every other sender's chunks
# (and commits) behind them.
_WAITERS_PER_PAIR = 4


class CollectiveKVReceiver(GrpcKVReceiver):
    def __init__(
        self, config: KVTransferConfig, sink: KVSink, layout: KVLayout | None = None
    ) -> None:
        super().__init__(config, sink, layout)
        self.device = layout.device if layout else "cpu"
        self.backend = backend_for(self.device)
        self._store: Any = None
        self._pairs: dict[str, PairGroup] = {}
        self._pending: dict[str, set[futures.Future[None]]] = {}  # transfer id -> chunk waits
        self._lock = threading.Lock()
        self._waiters: dict[str, futures.ThreadPoolExecutor] = {}  # pair id -> its waiters

    def start(self) -> str:
        import torch.distributed as dist

        self._store = dist.HashStore()  # in-process: reached only through Rendezvous
        return super().start()

    def stop(self) -> None:
        super().stop()
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            waiters, self._waiters = list(self._waiters.values()), {}
        for pool in waiters:
            pool.shutdown(wait=False, cancel_futures=True)
        for pair in pairs:
            pair.close()

    def _handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        handlers = super()._handlers()
        handlers["Connect"] = grpc.unary_unary_rpc_method_handler(
            self._connect,
            request_deserializer=pb.ConnectRequest.FromString,
            response_serializer=pb.ConnectResponse.SerializeToString,
        )
        handlers["PrepareChunk"] = grpc.unary_unary_rpc_method_handler(
            self._prepare_chunk,
            request_deserializer=pb.ChunkHeader.FromString,
            response_serializer=pb.PrepareChunkResponse.SerializeToString,
        )
        handlers["Rendezvous"] = grpc.unary_unary_rpc_method_handler(
            self._rendezvous,
            request_deserializer=pb.RendezvousRequest.FromString,
            response_serializer=pb.RendezvousResponse.SerializeToString,
        )
        return handlers

    def _connect(self, request: pb.ConnectRequest, context: grpc.ServicerContext) -> Any:
        if request.backend != self.backend:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this decode worker's KV cache is on {self.device} and needs {self.backend}, "
                f"the sender offered {request.backend!r}",
            )
        pair = PairGroup(secrets.token_urlsafe(16), rank=0, backend=self.backend)
        with self._lock:
            self._pairs[pair.pair_id] = pair
        host = self.endpoint.rsplit(":", 1)[0]
        timeout_s = self.config.reservation_timeout_s
        store = pair_store(self._store, pair.pair_id)

        def join() -> None:  # blocks until the sender joins too, so not on the RPC thread
            try:
                pair.group = form_group(store, 0, self.backend, host, timeout_s)
            except Exception as exc:
                pair.error = f"forming the process group failed: {exc}"
                self._drop_pair(pair)
            pair.ready.set()

        threading.Thread(target=join, name=f"kv-pair-{pair.pair_id[:6]}", daemon=True).start()
        return pb.ConnectResponse(pair_id=pair.pair_id, rank=1, timeout_s=timeout_s)

    def _rendezvous(self, request: pb.RendezvousRequest, context: grpc.ServicerContext) -> Any:
        with self._lock:
            known = request.pair_id in self._pairs
        if not known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no pair {request.pair_id!r}: connect first")
        store = pair_store(self._store, request.pair_id)
        try:
            return serve_rendezvous(store, request, self.config.reservation_timeout_s)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"op: {exc}")
        except RuntimeError as exc:  # a store wait timed out
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"rendezvous: {exc}")

    def _prepare_chunk(self, header: pb.ChunkHeader, context: grpc.ServicerContext) -> Any:
        import torch

        tid, spec = header.transfer_id, spec_of(header)
        try:
            self._table.validate(tid, spec)
            deadline = self._table.deadline(tid) or time.monotonic()
            pair = self._ready_pair(header.pair_id, deadline)
            buffer = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=self.device)
            with pair.lock:
                if pair.group is None:  # dropped by a failing chunk since we looked it up
                    raise TransferRejected(RejectReason.NOT_OPEN, f"pair {pair.pair_id} broke")
                tag = pair.next_tag()
                try:
                    work = pair.group.recv([buffer], 1, tag)
                except RuntimeError as exc:  # the peer is gone: so is this pair's group
                    self._drop_pair(pair)
                    raise TransferRejected(
                        RejectReason.NOT_OPEN, f"pair {pair.pair_id} broke: {exc}"
                    ) from exc
        except TransferRejected as exc:
            context.abort(STATUS_OF[exc.reason], str(exc))
        waiters = self._waiters_of(pair.pair_id)
        waiter = waiters.submit(self._finish_chunk, header, buffer, work, pair, deadline)
        with self._lock:
            self._pending.setdefault(tid, set()).add(waiter)
        waiter.add_done_callback(lambda done: self._forget(tid, done))
        return pb.PrepareChunkResponse(tag=tag)

    def _ready_pair(self, pair_id: str, deadline: float) -> PairGroup:
        with self._lock:
            pair = self._pairs.get(pair_id)
        if pair is None:
            raise TransferRejected(
                RejectReason.NOT_OPEN, f"no process group {pair_id!r}: reconnect"
            )
        if not pair.ready.wait(max(0.0, deadline - time.monotonic())) or pair.group is None:
            raise TransferRejected(
                RejectReason.NOT_OPEN, pair.error or f"pair {pair_id} not formed"
            )
        return pair

    def _finish_chunk(
        self, header: pb.ChunkHeader, buffer: Any, work: Any, pair: PairGroup, deadline: float
    ) -> None:
        tid = header.transfer_id
        try:
            try:
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except Exception as exc:  # the peer died or stalled: this pair's group is unusable
                self._drop_pair(pair)
                self._table.fail(
                    tid,
                    f"transfer {tid}: chunk {header.seq} never arrived: {exc}",
                    RejectReason.INVALID,
                )
            if wire.checksum(buffer) != header.checksum:
                self._table.fail(
                    tid,
                    f"transfer {tid}: chunk {header.seq} checksum mismatch",
                    RejectReason.CORRUPT,
                )
            self._table.write(tid, spec_of(header), buffer)
        except TransferRejected:
            pass  # recorded on the transfer: its commit fails with this message

    def _commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> Any:
        self._wait_for_chunks(request.transfer_id)
        return super()._commit(request, context)

    def seal(self, transfer_id: str) -> None:
        self._wait_for_chunks(transfer_id)
        super().seal(transfer_id)

    def _wait_for_chunks(self, transfer_id: str) -> None:
        """Chunks still in flight: commit (or seal) after them, by the deadline."""
        with self._lock:
            waiting = list(self._pending.get(transfer_id, ()))
        deadline = self._table.deadline(transfer_id)
        if waiting and deadline is not None:
            futures.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))

    def _forget(self, transfer_id: str, done: futures.Future[None]) -> None:
        with self._lock:
            waits = self._pending.get(transfer_id)
            if waits is not None:
                waits.discard(done)
                if not waits:
                    del self._pending[transfer_id]

    def _waiters_of(self, pair_id: str) -> futures.ThreadPoolExecutor:
        with self._lock:
            pool = self._waiters.get(pair_id)
            if pool is None:  # its threads start with its first chunks
                pool = futures.ThreadPoolExecutor(
                    _WAITERS_PER_PAIR, thread_name_prefix=f"kv-coll-wait-{pair_id[:8]}"
                )
                self._waiters[pair_id] = pool
            return pool

    def _drop_pair(self, pair: PairGroup) -> None:
        with self._lock:
            self._pairs.pop(pair.pair_id, None)
            pool = self._waiters.pop(pair.pair_id, None)
        if pool is not None:  # its queued waits still run, and end at once: the group is gone
            pool.shutdown(wait=False)
        pair.close()
