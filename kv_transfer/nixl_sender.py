"""Prefill side of the nixl transport: exposes a transfer's KV to the decode worker's READ.

Per transfer: gather every layer of the source blocks (`read_kv`, a layer range at a time, as
the other transports do) into one registered staging buffer (`nixl_staging.py`: kept between
transfers), take its checksum, and send `PullKV` (agent metadata, address, checksum, trace
context) to the decode worker, which READs it into the reserved blocks and answers once they
landed and matched the checksum; meanwhile this side drives its agent's progress (it has no
progress thread). Then `Commit` over the same gRPC control channel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kv_transfer import wire
from kv_transfer.base import KVSender, KVTransferError, TransferRequest, TransferResult
from kv_transfer.grpc_common import SERVICE, rpc_error_text
from kv_transfer.grpc_sender import ControlClient, layer_ranges
from kv_transfer.nixl_agent import drive, make_agent, memory_type, nixl_module
from kv_transfer.nixl_staging import StagingBuffer, StagingPool
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb


class NixlKVSender(KVSender):
    """`tamper` (tests only) may change the gathered KV after its checksum was taken."""

    def __init__(
        self, config: KVTransferConfig, *, tamper: Callable[[int, Any], None] | None = None
    ) -> None:
        nixl_module()  # fail now, not on the first transfer, if NIXL is not installed
        self._client = ControlClient(config)
        self._pool: StagingPool | None = None  # with this process's NIXL agent, on first use
        self._lock = threading.Lock()
        self.tamper = tamper

    def send(self, request: TransferRequest) -> TransferResult:
        start = time.perf_counter()
        deadline = start + (request.timeout_s or self._client.config.reservation_timeout_s)
        stub = self._client.stub(request.endpoint)
        nbytes = 0
        try:
            if request.src_block_ids:
                nbytes = self._offer(request, stub.channel, deadline)
            self._client.commit(stub, request, deadline)
        except grpc.RpcError as exc:
            raise KVTransferError(rpc_error_text(request.endpoint, exc)) from None
        return TransferResult(nbytes, 1 if nbytes else 0, time.perf_counter() - start)

    def _offer(self, request: TransferRequest, channel: grpc.Channel, deadline: float) -> int:
        """Gathers the KV into a registered buffer and waits until the decode worker read it."""
        pool = self._pool_or_start()
        src, num_layers = request.src_block_ids, request.num_layers
        first = request.read_kv(src, 0, 1)  # one layer tells the bytes per layer (reused below)
        try:
            buffer = pool.acquire(first.nbytes * num_layers, first.device)
        except Exception as exc:  # NIXL cannot register this memory
            raise KVTransferError(f"registering KV with NIXL failed: {exc}") from exc
        delivered = False
        try:
            data = buffer.view(first.dtype, (num_layers, *first.shape[1:]))
            ranges = layer_ranges(num_layers, first.nbytes, self._client.config.chunk_bytes)
            for l0, l1 in ranges:  # chunk by chunk: small gathers stay in warm memory
                data[l0:l1] = first if (l0, l1) == (0, 1) else request.read_kv(src, l0, l1)
            header = wire.chunk_header(request, 0, 0, num_layers, data, wire.checksum(data))
            if self.tamper is not None:
                self.tamper(0, data)
            reply = self._pull(channel, pool.agent, buffer, header, data, deadline)
            delivered = True
        finally:  # a buffer a late READ might still read is not reused
            pool.release(buffer, reusable=delivered)
        return reply.bytes

    def _pull(
        self,
        channel: grpc.Channel,
        agent: Any,
        buffer: StagingBuffer,
        header: pb.ChunkHeader,
        data: Any,
        deadline: float,
    ) -> pb.PullKVResponse:
        memory, device_id = memory_type(data)
        pull = channel.unary_unary(
            f"/{SERVICE}/PullKV",
            request_serializer=pb.PullKVRequest.SerializeToString,
            response_deserializer=pb.PullKVResponse.FromString,
        )
        call = pull.future(
            pb.PullKVRequest(
                header=header,
                agent_metadata=buffer.agent_metadata,
                address=data.data_ptr(),
                memory=memory,
                device_id=device_id,
            ),
            timeout=max(0.001, deadline - time.perf_counter()),
            metadata=self._client.metadata,
        )
        # Serve the receiver's READ (over TCP it needs this side's progress) until it answers.
        drive(agent, call.done, lambda: False)
        return call.result()

    def _pool_or_start(self) -> StagingPool:
        with self._lock:
            if self._pool is None:
                self._pool = StagingPool(make_agent("prefill", self._client.config.nixl_ucx_tls))
            return self._pool

    def abort(self, endpoint: str, transfer_id: str) -> None:
        self._client.abort(endpoint, transfer_id)

    def close(self) -> None:
        self._client.close()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
