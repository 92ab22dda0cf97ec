"""Prefill side of the grpc transport: streams a transfer's chunks to the KV endpoint, commits.

Chunks are produced lazily by the request iterator, which gRPC drains on its own thread: reading
the KV of chunk k+1 and its CRC (which releases the GIL) overlap with sending chunk k.

A simulated engine's `read_kv` returns `SimulatedKV` (pdserve/sim/kv.py): its chunks carry the
real header (shape, dtype, layers) with an empty payload, and each takes as long to produce as
its modelled bytes take on the modelled link.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from kv_transfer import tls, wire
from kv_transfer.base import KVSender, KVTransferError, TransferRequest, TransferResult
from kv_transfer.grpc_common import (
    CHANNEL_OPTIONS,
    SECRET_METADATA_KEY,
    SERVICE,
    resolve_secret,
    rpc_error_text,
)
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb
from pdserve.sim.kv import SimulatedKV

_PREFETCH = 2  # encoded chunks buffered ahead of gRPC (memory: 2 x chunk_bytes)


@dataclass
class ControlStub:
    """Callables of one receiver's KVTransfer service (shared by both transports)."""

    channel: grpc.Channel
    push: grpc.StreamUnaryMultiCallable
    commit: grpc.UnaryUnaryMultiCallable
    abort: grpc.UnaryUnaryMultiCallable
    connect: grpc.UnaryUnaryMultiCallable
    prepare: grpc.UnaryUnaryMultiCallable
    rendezvous: grpc.UnaryUnaryMultiCallable

    @classmethod
    def dial(cls, endpoint: str, config: KVTransferConfig | None = None) -> ControlStub:
        """A channel to `endpoint`, over TLS when `config` has TLS files."""
        credentials = tls.channel_credentials(config) if config else None
        if credentials is None:
            channel = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        else:
            options = CHANNEL_OPTIONS + tls.channel_options(config)
            channel = grpc.secure_channel(endpoint, credentials, options=options)

        def unary(name: str, req: type, resp: type) -> grpc.UnaryUnaryMultiCallable:
            return channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=req.SerializeToString,
                response_deserializer=resp.FromString,
            )

        return cls(
            channel=channel,
            # Requests are already-encoded KVChunk bytes (see wire.encode_chunk).
            push=channel.stream_unary(
                f"/{SERVICE}/PushChunks",
                request_serializer=None,
                response_deserializer=pb.PushChunksResponse.FromString,
            ),
            commit=unary("Commit", pb.CommitRequest, pb.CommitResponse),
            abort=unary("Abort", pb.AbortRequest, pb.AbortResponse),
            connect=unary("Connect", pb.ConnectRequest, pb.ConnectResponse),
            prepare=unary("PrepareChunk", pb.ChunkHeader, pb.PrepareChunkResponse),
            rendezvous=unary("Rendezvous", pb.RendezvousRequest, pb.RendezvousResponse),
        )


def commit_request(request: TransferRequest) -> pb.CommitRequest:
    commit = request.commit
    return pb.CommitRequest(
        transfer_id=request.transfer_id,
        first_token_id=commit.first_token_id,
        first_logprob=commit.first_logprob,
        num_prompt_tokens=commit.num_prompt_tokens,
        trace_context=commit.trace_context or request.trace_context,
    )


def layer_ranges(num_layers: int, layer_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Splits [0, num_layers) into ranges of about chunk_bytes (at least one layer each)."""
    per_chunk = max(1, chunk_bytes // max(1, layer_bytes))
    return [(l0, min(num_layers, l0 + per_chunk)) for l0 in range(0, num_layers, per_chunk)]


class ControlClient:
    """Channels to receivers, one per endpoint, shared by every transfer; plus the secret."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.metadata = ((SECRET_METADATA_KEY, resolve_secret(config)),)
        self._stubs: dict[str, ControlStub] = {}
        self._lock = threading.Lock()

    def stub(self, endpoint: str) -> ControlStub:
        with self._lock:
            if endpoint not in self._stubs:
                self._stubs[endpoint] = ControlStub.dial(endpoint, self.config)
            return self._stubs[endpoint]

    def commit(self, stub: ControlStub, request: TransferRequest, deadline: float) -> None:
        """Tells the receiver the transfer is complete, within what is left of `deadline`;
        nothing for a push-only request (one rank's part of a tensor-parallel handoff)."""
        if request.commit is None:
            return
        stub.commit(
            commit_request(request),
            timeout=max(0.001, deadline - time.perf_counter()),
            metadata=self.metadata,
        )

    def abort(self, endpoint: str, transfer_id: str) -> None:
        # An unreachable receiver is fine: its reaper frees the blocks at the deadline.
        with contextlib.suppress(grpc.RpcError):
            self.stub(endpoint).abort(
                pb.AbortRequest(transfer_id=transfer_id), timeout=5.0, metadata=self.metadata
            )

    def close(self) -> None:
        with self._lock:
            stubs, self._stubs = list(self._stubs.values()), {}
        for stub in stubs:
            stub.channel.close()


class GrpcKVSender(KVSender):
    """Pushes chunks over the PushChunks stream; `tamper` (tests only) edits each encoded chunk."""

    def __init__(
        self, config: KVTransferConfig, *, tamper: Callable[[int, bytes], bytes] | None = None
    ) -> None:
        self._client = ControlClient(config)
        self.tamper = tamper

    def send(self, request: TransferRequest) -> TransferResult:
        start = time.perf_counter()
        deadline = start + (request.timeout_s or self._client.config.reservation_timeout_s)
        stub = self._client.stub(request.endpoint)
        totals = [0, 0]  # chunks, bytes
        failure: list[BaseException] = []
        try:
            if request.src_block_ids:
                chunks = self._chunks(request, totals, failure)
                stub.push(
                    chunks, timeout=deadline - time.perf_counter(), metadata=self._client.metadata
                )
            self._client.commit(stub, request, deadline)
        except grpc.RpcError as exc:
            if failure:  # read_kv raised inside gRPC's thread: report that, not CANCELLED
                raise KVTransferError(f"reading KV failed: {failure[0]!r}") from failure[0]
            raise KVTransferError(rpc_error_text(request.endpoint, exc)) from None
        return TransferResult(totals[1], totals[0], time.perf_counter() - start)

    def _chunks(
        self, request: TransferRequest, totals: list[int], failure: list[BaseException]
    ) -> Iterator[bytes]:
        """Yields encoded chunks produced by a helper thread, a couple ahead: gRPC's request
        thread only pulls the next message once the previous one is written, so producing
        (gather, CRC, framing) on that thread would serialize it with sending."""
        ready: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=_PREFETCH)
        stop = threading.Event()

        def offer(item: bytes | BaseException | None) -> bool:
            while not stop.is_set():  # never block forever on a consumer that went away
                with contextlib.suppress(queue.Full):
                    ready.put(item, timeout=0.1)
                    return True
            return False

        def produce() -> None:
            try:
                for encoded in self._encode_chunks(request, totals):
                    if not offer(encoded):
                        return
                offer(None)
            except BaseException as exc:  # reported by send(), not lost in this thread
                failure.append(exc)
                offer(exc)

        producer = threading.Thread(target=produce, name="kv-chunks", daemon=True)
        producer.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # the call failed or was cancelled: let the producer exit

    def _encode_chunks(self, request: TransferRequest, totals: list[int]) -> Iterator[bytes]:
        config, src = self._client.config, request.src_block_ids
        first = request.read_kv(src, 0, 1)  # one layer tells the bytes per layer (reused below)
        ranges = layer_ranges(request.num_layers, first.nbytes, config.chunk_bytes)
        for seq, (l0, l1) in enumerate(ranges):
            data = first if (l0, l1) == (0, 1) else request.read_kv(src, l0, l1)
            if isinstance(data, SimulatedKV):
                time.sleep(data.link_seconds)
                payload = memoryview(b"")
            else:
                data = data.cpu().contiguous()  # gRPC needs host bytes; CPU tensors stay in place
                payload = wire.tensor_bytes(data)
            header = wire.chunk_header(request, seq, l0, l1, data, wire.payload_checksum(payload))
            encoded = wire.encode_chunk(header, payload)
            if self.tamper is not None:
                encoded = self.tamper(seq, encoded)
            totals[0] += 1
            totals[1] += data.nbytes
            yield encoded

    def abort(self, endpoint: str, transfer_id: str) -> None:
        self._client.abort(endpoint, transfer_id)

    def close(self) -> None:
        self._client.close()
