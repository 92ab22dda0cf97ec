"""Prefill side of the collective transport: announces each chunk over gRPC, sends its payload
with torch.distributed point-to-point `send` (NCCL for CUDA tensors, Gloo for CPU ones)."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kv_transfer import wire
from kv_transfer.base import KVSender, KVTransferError, TransferRequest, TransferResult
from kv_transfer.collective_group import PairGroup, backend_for, form_group, local_ip_towards
from kv_transfer.grpc_common import rpc_error_text
from kv_transfer.grpc_sender import ControlClient, layer_ranges
from kv_transfer.rendezvous import RemoteStore
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb

_IN_FLIGHT = 2  # sends outstanding per transfer: overlaps reading chunk k+1 with sending k


class CollectiveKVSender(KVSender):
    """`tamper` (tests only) may change a chunk's tensor after its checksum was taken."""

    def __init__(
        self, config: KVTransferConfig, *, tamper: Callable[[int, Any], None] | None = None
    ) -> None:
        self._client = ControlClient(config)
        self._pairs: dict[str, PairGroup] = {}  # endpoint -> this side of the pair's group
        self._lock = threading.Lock()
        self.tamper = tamper

    def send(self, request: TransferRequest) -> TransferResult:
        start = time.perf_counter()
        deadline = start + (request.timeout_s or self._client.config.reservation_timeout_s)
        stub = self._client.stub(request.endpoint)
        pair: PairGroup | None = None
        chunks = nbytes = 0
        try:
            if request.src_block_ids:
                first = request.read_kv(request.src_block_ids, 0, 1)
                pair = self._pair(request.endpoint, backend_for(str(first.device)), deadline)
                chunks, nbytes = self._push(request, first, pair, deadline)
            self._client.commit(stub, request, deadline)
        except grpc.RpcError as exc:
            raise KVTransferError(rpc_error_text(request.endpoint, exc)) from None
        except RuntimeError as exc:  # torch.distributed: peer gone or timed out
            if pair is not None:
                self._drop(request.endpoint, pair)
            raise KVTransferError(f"KV send to {request.endpoint} failed: {exc}") from exc
        return TransferResult(nbytes, chunks, time.perf_counter() - start)

    def _push(
        self, request: TransferRequest, first: Any, pair: PairGroup, deadline: float
    ) -> tuple[int, int]:
        ranges = layer_ranges(request.num_layers, first.nbytes, self._client.config.chunk_bytes)
        in_flight: list[tuple[Any, Any]] = []  # (work, tensor): the tensor lives until sent
        try:
            return len(ranges), self._push_ranges(request, first, pair, deadline, ranges, in_flight)
        finally:  # even on failure: never free a tensor a send may still be reading
            for work, _ in in_flight:
                with contextlib.suppress(RuntimeError):
                    _wait(work, deadline)

    def _push_ranges(
        self,
        request: TransferRequest,
        first: Any,
        pair: PairGroup,
        deadline: float,
        ranges: list[tuple[int, int]],
        in_flight: list[tuple[Any, Any]],
    ) -> int:
        stub, src, nbytes = self._client.stub(request.endpoint), request.src_block_ids, 0
        for seq, (l0, l1) in enumerate(ranges):
            data = first if (l0, l1) == (0, 1) else request.read_kv(src, l0, l1)
            data = data.contiguous()
            header = wire.chunk_header(
                request, seq, l0, l1, data, wire.checksum(data), pair_id=pair.pair_id
            )
            if self.tamper is not None:
                self.tamper(seq, data)
            with pair.lock:  # announce + send adjacent: receives are posted in send order
                ready = stub.prepare(
                    header, timeout=_remaining(deadline), metadata=self._client.metadata
                )
                in_flight.append((pair.group.send([data], 0, ready.tag), data))
            nbytes += data.nbytes
            while len(in_flight) > _IN_FLIGHT:
                _wait(in_flight[0][0], deadline)
                in_flight.pop(0)
        while in_flight:
            _wait(in_flight[0][0], deadline)  # raises on a dead peer: send() reports it
            in_flight.pop(0)
        return nbytes

    def _pair(self, endpoint: str, backend: str, deadline: float) -> PairGroup:
        """This sender's group with the receiver at `endpoint`, formed on first use. Only the
        sends to `endpoint` wait for its forming: the sender-wide lock is held just to look the
        pair up, so a frozen receiver's Connect (up to the whole deadline) cannot hold the
        sends to every other decode worker, which the router sees as a healthy but stuck
        prefill worker and cannot fail over."""
        with self._lock:
            pair = self._pairs.get(endpoint)
            forming = pair is None
            if forming:  # placeholder: pair id and rank come with the Connect reply
                pair = self._pairs[endpoint] = PairGroup("", rank=1, backend=backend)
        if not forming:
            return _formed(pair, endpoint, deadline)
        try:
            stub, metadata = self._client.stub(endpoint), self._client.metadata
            reply = stub.connect(
                pb.ConnectRequest(backend=backend), timeout=_remaining(deadline), metadata=metadata
            )
            pair.pair_id, pair.rank = reply.pair_id, reply.rank
            store = RemoteStore(stub.rendezvous, endpoint, reply.pair_id, metadata, reply.timeout_s)
            my_host = local_ip_towards(endpoint.rsplit(":", 1)[0])
            pair.group = form_group(store, reply.rank, backend, my_host, reply.timeout_s)
            with self._lock:
                closed = self._pairs.get(endpoint) is not pair
            if closed:  # close() ran while this formed: it could not abort the group then
                raise RuntimeError("the sender was closed")
        except Exception as exc:
            pair.error = f"forming the process group with {endpoint} failed: {exc}"
            self._drop(endpoint, pair)
            raise
        finally:
            pair.ready.set()  # the sends waiting in _formed look again
        return pair

    def _drop(self, endpoint: str, pair: PairGroup) -> None:
        with self._lock:
            if self._pairs.get(endpoint) is pair:
                del self._pairs[endpoint]
        pair.close()

    def abort(self, endpoint: str, transfer_id: str) -> None:
        self._client.abort(endpoint, transfer_id)

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close()
        self._client.close()


def _formed(pair: PairGroup, endpoint: str, deadline: float) -> PairGroup:
    """`pair` once another send has formed it; RuntimeError (a failed send) if it is not
    formed by `deadline` or its forming failed."""
    if not pair.ready.wait(_remaining(deadline)):
        raise RuntimeError(f"the process group with {endpoint} is still forming")
    if pair.group is None:
        raise RuntimeError(pair.error or f"the process group with {endpoint} broke")
    return pair


def _remaining(deadline: float) -> float:
    return max(0.001, deadline - time.perf_counter())


def _wait(work: Any, deadline: float) -> None:
    work.wait(datetime.timedelta(seconds=_remaining(deadline)))
