"""Prefill side of the nixl transport: exposes a transfer's KV to the decode worker's READ.

Per transfer: gather every layer of the source blocks into one tensor (`read_kv`, as the other
transports do), take its checksum, register it with this process's NIXL agent for the length of
the transfer only, and send `PullKV` (agent metadata, address, checksum, trace context) to the
decode worker, which READs it into the reserved blocks and answers once they landed and matched
the checksum; then deregister and `Commit` over the same gRPC control channel.
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
from kv_transfer.grpc_sender import ControlClient, commit_request
from kv_transfer.nixl_agent import make_agent, memory_type, nixl_module
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb


class NixlKVSender(KVSender):
    """`tamper` (tests only) may change the gathered KV after its checksum was taken."""

    def __init__(
        self, config: KVTransferConfig, *, tamper: Callable[[int, Any], None] | None = None
    ) -> None:
        nixl_module()  # fail now, not on the first transfer, if NIXL is not installed
        self._client = ControlClient(config)
        self._agent: Any = None
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
            stub.commit(
                commit_request(request),
                timeout=max(0.001, deadline - time.perf_counter()),
                metadata=self._client.metadata,
            )
        except grpc.RpcError as exc:
            raise KVTransferError(rpc_error_text(request.endpoint, exc)) from None
        return TransferResult(nbytes, 1 if nbytes else 0, time.perf_counter() - start)

    def _offer(self, request: TransferRequest, channel: grpc.Channel, deadline: float) -> int:
        """Registers the gathered KV and waits until the decode worker read it."""
        data = request.read_kv(request.src_block_ids, 0, request.num_layers).contiguous()
        header = wire.chunk_header(request, 0, 0, request.num_layers, data, wire.checksum(data))
        if self.tamper is not None:
            self.tamper(0, data)
        agent = self._agent_or_start()
        try:
            registration = agent.register_memory(data)
            agent_metadata = agent.get_partial_agent_metadata(registration, inc_conn_info=True)
        except Exception as exc:  # NIXL cannot register this memory
            raise KVTransferError(f"registering KV with NIXL failed: {exc}") from exc
        memory, device_id = memory_type(data)
        pull = channel.unary_unary(
            f"/{SERVICE}/PullKV",
            request_serializer=pb.PullKVRequest.SerializeToString,
            response_deserializer=pb.PullKVResponse.FromString,
        )
        try:
            reply = pull(
                pb.PullKVRequest(
                    header=header,
                    agent_metadata=agent_metadata,
                    address=data.data_ptr(),
                    memory=memory,
                    device_id=device_id,
                ),
                timeout=max(0.001, deadline - time.perf_counter()),
                metadata=self._client.metadata,
            )
        finally:  # answered (the READ ended) or timed out: the memory is this process's again
            agent.deregister_memory(registration)
        return reply.bytes

    def _agent_or_start(self) -> Any:
        with self._lock:
            if self._agent is None:
                self._agent = make_agent("prefill", self._client.config.nixl_ucx_tls)
            return self._agent

    def abort(self, endpoint: str, transfer_id: str) -> None:
        self._client.abort(endpoint, transfer_id)

    def close(self) -> None:
        self._client.close()
