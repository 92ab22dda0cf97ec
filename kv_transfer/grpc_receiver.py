"""Decode side of the grpc transport: the KV endpoint (a `pdserve.v1.KVTransfer` gRPC server).

The server is a sync `grpc.server` with its own thread pool, so verifying checksums and copying
KV into the cache never runs on the decode worker's event loop or engine thread. The collective
receiver reuses this server for its control plane and adds two methods.

A receiver whose layout is on the "sim" device (a simulated engine) never builds a tensor: it
checks each chunk's header as usual and hands the sink a `SimulatedKV` of that shape. Chunks
with an empty payload (from a simulated sender) are only accepted there; a real cache rejects
them as the wrong size.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from kv_transfer import tls, wire
from kv_transfer.base import CommitInfo, KVLayout, KVReceiver, KVSink
from kv_transfer.grpc_common import (
    CHANNEL_OPTIONS,
    SERVICE,
    STATUS_OF,
    SecretInterceptor,
    advertise_host,
    bind_host,
    resolve_secret,
)
from kv_transfer.reservations import (
    ChunkSpec,
    RejectReason,
    ReservationTable,
    TransferRejected,
    TransferState,
)
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb
from pdserve.sim.kv import SIM_DEVICE, SimulatedKV
from pdserve.sim.model_shape import DTYPE_BYTES

_SERVER_THREADS = 8  # concurrent KV streams a decode worker accepts; more wait in gRPC's queue


def spec_of(header: pb.ChunkHeader) -> ChunkSpec:
    return ChunkSpec(
        header.layer_start,
        header.layer_end,
        header.num_layers,
        header.dtype,
        tuple(header.shape),
        header.seq,
        header.kv_head_start,
    )


class GrpcKVReceiver(KVReceiver):
    """Serves PushChunks/Commit/Abort over one ReservationTable."""

    def __init__(
        self, config: KVTransferConfig, sink: KVSink, layout: KVLayout | None = None
    ) -> None:
        self.config = config
        self.layout = layout
        self._secret = resolve_secret(config)
        self._table = ReservationTable(sink, layout, config.reservation_timeout_s)
        self._server: grpc.Server | None = None
        # Verifies and writes chunks while the stream handlers read the next ones.
        self._writer = futures.ThreadPoolExecutor(_SERVER_THREADS, thread_name_prefix="kv-write")
        self.endpoint = ""

    # -- KVReceiver -------------------------------------------------------------------------

    def start(self) -> str:
        assert self._server is None, "start() called twice"
        server = grpc.server(
            futures.ThreadPoolExecutor(_SERVER_THREADS, thread_name_prefix="kv-recv"),
            interceptors=[SecretInterceptor(self._secret)],
            options=CHANNEL_OPTIONS,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, self._handlers()),)
        )
        address = f"{bind_host(self.config)}:{self.config.port}"
        credentials = tls.server_credentials(self.config)
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
        if port == 0:
            raise OSError(f"cannot bind the KV endpoint on {address}")
        server.start()
        self._server = server
        self.endpoint = f"{advertise_host(self.config)}:{port}"
        return self.endpoint

    def open(
        self,
        dest_block_ids: list[int],
        deadline_s: float | None = None,
        trace_context: dict[str, str] | None = None,
        transfer_id: str | None = None,
    ) -> str:
        return self._table.open(dest_block_ids, deadline_s, trace_context or {}, transfer_id)

    def seal(self, transfer_id: str) -> None:
        """Ends this rank's part of a tensor-parallel handoff as committed once every layer of
        its heads arrived (no more writes into its blocks); raises TransferRejected if not."""
        self._table.seal(transfer_id)

    def abort(self, transfer_id: str) -> bool:
        return self._table.abort(transfer_id, notify_sink=False)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
            self._server = None
        self._writer.shutdown(wait=False)
        self._table.close()

    def state(self, transfer_id: str) -> TransferState | None:
        """The transfer's state, or None if unknown (for stats and tests)."""
        return self._table.state(transfer_id)

    def open_transfer_ids(self) -> list[str]:
        return self._table.open_ids()

    # -- RPC handlers -----------------------------------------------------------------------

    def _handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "PushChunks": grpc.stream_unary_rpc_method_handler(
                self._push_chunks,
                request_deserializer=wire.decode_chunk,  # zero-copy split of header and payload
                response_serializer=pb.PushChunksResponse.SerializeToString,
            ),
            "Commit": grpc.unary_unary_rpc_method_handler(
                self._commit,
                request_deserializer=pb.CommitRequest.FromString,
                response_serializer=pb.CommitResponse.SerializeToString,
            ),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self._abort,
                request_deserializer=pb.AbortRequest.FromString,
                response_serializer=pb.AbortResponse.SerializeToString,
            ),
        }

    def _push_chunks(
        self, chunks: Iterator[tuple[pb.ChunkHeader, memoryview]], context: grpc.ServicerContext
    ) -> pb.PushChunksResponse:
        count = nbytes = 0
        # Chunk i is verified and written on a helper thread while this thread reads chunk i+1
        # off the stream: HTTP/2 flow control stalls the sender until we read, so doing both
        # on one thread would serialize checksum + copy with the network. One chunk in flight
        # keeps chunks in order and bounds the memory held.
        pending: futures.Future | None = None
        try:
            for header, payload in chunks:
                if pending is not None:
                    pending.result()
                pending = self._writer.submit(self._write_chunk, header, payload)
                count += 1
                nbytes += payload.nbytes
            if pending is not None:
                pending.result()
        except TransferRejected as exc:
            context.abort(STATUS_OF[exc.reason], str(exc))
        return pb.PushChunksResponse(chunks=count, bytes=nbytes)

    def _write_chunk(self, header: pb.ChunkHeader, payload: memoryview) -> None:
        tid, spec = header.transfer_id, spec_of(header)
        self._table.validate(tid, spec)  # cheap checks first: fenced ids cost no CRC work
        if wire.payload_checksum(payload) != header.checksum:
            self._table.fail(
                tid, f"transfer {tid}: chunk {header.seq} checksum mismatch", RejectReason.CORRUPT
            )
        try:
            data = self._chunk_data(header, payload)
        except ValueError as exc:
            self._table.fail(
                tid, f"transfer {tid}: chunk {header.seq}: {exc}", RejectReason.INVALID
            )
        self._table.write(tid, spec, data)

    def _chunk_data(self, header: pb.ChunkHeader, payload: memoryview) -> Any:
        """The chunk as the sink takes it: a tensor viewing the payload, or for a simulated
        cache a SimulatedKV of the header's shape (whatever the payload held)."""
        if self.layout is not None and self.layout.device == SIM_DEVICE:
            if header.dtype not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {header.dtype!r}")
            return SimulatedKV(tuple(header.shape), header.dtype, DTYPE_BYTES[header.dtype])
        return wire.tensor_from_payload(payload, header.dtype, list(header.shape))

    def _commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> Any:
        info = CommitInfo(
            first_token_id=request.first_token_id,
            first_logprob=request.first_logprob if request.HasField("first_logprob") else None,
            num_prompt_tokens=request.num_prompt_tokens,
            trace_context=dict(request.trace_context),
        )
        try:
            self._table.commit(request.transfer_id, info)
        except TransferRejected as exc:
            context.abort(STATUS_OF[exc.reason], str(exc))
        return pb.CommitResponse()

    def _abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> Any:
        # A remote abort: the decode worker did not ask for it, so the sink must free the blocks.
        return pb.AbortResponse(was_open=self._table.abort(request.transfer_id, notify_sink=True))
