"""Prefill side of the nixl transport: exposes the prefill KV cache to the decode worker's READ.

The prefill worker's whole KV cache is registered with this process's NIXL agent once, on the
first transfer. Per transfer: send `PullKV` (agent metadata, the cache's address and blocks per
plane, the source block of each reserved block, trace context) to the decode worker, which
READs the blocks straight from the cache into the reserved ones — no gather, no staging copy —
and answers with the checksum of what landed. Meanwhile this side takes the checksum of the
same bytes in place (another thread; crc32c frees the GIL) and drives its agent's progress (it
has no progress thread; over TCP the READ needs it). `Commit` follows over the same gRPC control
channel only if the two checksums are equal; otherwise the transfer is aborted (DATA_LOSS).
The source blocks are held by the caller for the whole `send`, so what is read is what was
checksummed. `TransferRequest.read_kv` is not used: the blocks are read where they lie. A
tensor-parallel rank's part (`TransferRequest.src_heads`, kv_transfer/tp_handoff.py) offers
only those heads of its cache, and the checksum covers only them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kv_transfer import wire
from kv_transfer.base import KVSender, KVTransferError, TransferRequest, TransferResult
from kv_transfer.grpc_common import SERVICE, rpc_error_text
from kv_transfer.grpc_sender import ControlClient
from kv_transfer.nixl_agent import (
    block_runs,
    drive,
    make_agent,
    memory_type,
    nixl_module,
    position_regions,
    regions_checksum,
    run_regions,
)
from pdserve.config import KVTransferConfig
from pdserve.pb import kv_transfer_pb2 as pb


@dataclass
class _Registration:
    agent: Any
    handle: Any  # what deregister_memory takes
    agent_metadata: bytes  # the agent's partial metadata: connection info and the cache


class NixlKVSender(KVSender):
    """`kv_cache` is the prefill engine's cache `[layers, 2, blocks, block_size, heads,
    head_dim]`: the decode worker reads the transfers' blocks from it. `tamper` (tests only)
    changes a copy of the blocks this side's checksum is then taken over, so the checksums
    disagree as when KV changes in transit (the cache itself is left alone)."""

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache: Any = None,
        *,
        tamper: Callable[[int, Any], None] | None = None,
    ) -> None:
        if kv_cache is None or not kv_cache.is_contiguous() or kv_cache.dim() != 6:
            raise ValueError(
                "the nixl transport reads from the KV cache itself: pass kv_cache, the engine's "
                "contiguous [layers, 2, blocks, block_size, heads, head_dim] tensor"
            )
        nixl_module()  # fail now, not on the first transfer, if NIXL is not installed
        self._client = ControlClient(config)
        self.cache = kv_cache
        self._registration: _Registration | None = None
        self._lock = threading.Lock()
        self._checksums = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nixl-crc")
        self.tamper = tamper
        # Now, at the worker's start, not on its first transfer: the first agent of a process
        # loads UCX (about 2 s on an idle 2-core host, over 5 s on a loaded one), holding the
        # worker's threads, and the router failed the worker's first request over for it.
        self._registered()

    def send(self, request: TransferRequest) -> TransferResult:
        start = time.perf_counter()
        deadline = start + (request.timeout_s or self._client.config.reservation_timeout_s)
        stub = self._client.stub(request.endpoint)
        read = pb.PullKVResponse()
        try:
            if request.src_block_ids:
                read = self._offer(request, stub.channel, deadline)
            self._client.commit(stub, request, deadline)
        except grpc.RpcError as exc:
            raise KVTransferError(rpc_error_text(request.endpoint, exc)) from None
        seconds = time.perf_counter() - start
        return TransferResult(
            read.bytes, 1 if read.bytes else 0, seconds, descriptors=read.descriptors
        )

    def _offer(
        self, request: TransferRequest, channel: grpc.Channel, deadline: float
    ) -> pb.PullKVResponse:
        """Has the decode worker read the blocks (of the heads `request.src_heads`); returns
        its answer (bytes read, descriptors) once the checksums matched."""
        cache, src = self.cache, request.src_block_ids
        if request.num_layers != cache.shape[0]:
            raise KVTransferError(
                f"transfer {request.transfer_id}: {request.num_layers} layers asked for, the "
                f"registered KV cache has {cache.shape[0]}"
            )
        registration = self._registered()
        heads = request.src_heads or (0, cache.shape[4])
        if self.tamper is None:
            rows = source_rows(cache, src, heads)
            expected = self._checksums.submit(regions_checksum, cache, rows)
        else:
            copy = cache[:, :, src, :, heads[0] : heads[1]].contiguous()
            self.tamper(0, copy)
            expected = self._checksums.submit(wire.checksum, copy)
        reply = self._pull(channel, registration, request, deadline)
        if reply.checksum != expected.result():
            self._client.abort(request.endpoint, request.transfer_id)
            raise KVTransferError(
                f"{request.endpoint}: DATA_LOSS: transfer {request.transfer_id}: checksum "
                "mismatch: the KV that landed differs from the source"
            )
        return reply

    def _pull(
        self,
        channel: grpc.Channel,
        registration: _Registration,
        request: TransferRequest,
        deadline: float,
    ) -> pb.PullKVResponse:
        cache, src = self.cache, request.src_block_ids
        memory, device_id = memory_type(cache)
        heads = request.src_heads or (0, cache.shape[4])
        # The header's dtype and shape are those of the reserved blocks' KV (of the heads
        # read); a meta tensor carries them without bytes.
        shape = (cache.shape[0], 2, len(src), cache.shape[3], heads[1] - heads[0], cache.shape[5])
        described = cache.new_empty(shape, device="meta")
        pull = channel.unary_unary(
            f"/{SERVICE}/PullKV",
            request_serializer=pb.PullKVRequest.SerializeToString,
            response_deserializer=pb.PullKVResponse.FromString,
        )
        call = pull.future(
            pb.PullKVRequest(
                header=wire.chunk_header(request, 0, 0, request.num_layers, described, 0),
                agent_metadata=registration.agent_metadata,
                address=cache.data_ptr(),
                memory=memory,
                device_id=device_id,
                src_block_ids=src,
                src_num_blocks=cache.shape[2],
                src_num_heads=cache.shape[4],
                src_head_start=heads[0],
            ),
            timeout=max(0.001, deadline - time.perf_counter()),
            metadata=self._client.metadata,
        )
        # Serve the receiver's READ (over TCP it needs this side's progress) until it answers.
        drive(registration.agent, call.done, lambda: False)
        return call.result()

    def _registered(self) -> _Registration:
        with self._lock:
            if self._registration is None:
                config = self._client.config
                agent = make_agent("prefill", config.nixl_ucx_tls, config.bind_host)
                try:
                    handle = agent.register_memory(self.cache)
                except Exception as exc:  # NIXL cannot register this memory
                    raise KVTransferError(
                        f"registering the KV cache with NIXL failed: {exc}"
                    ) from exc
                metadata = agent.get_partial_agent_metadata(handle, inc_conn_info=True)
                self._registration = _Registration(agent, handle, metadata)
            return self._registration

    def abort(self, endpoint: str, transfer_id: str) -> None:
        self._client.abort(endpoint, transfer_id)

    def close(self) -> None:
        self._client.close()
        with self._lock:
            registration, self._registration = self._registration, None
        if registration is not None:
            with contextlib.suppress(Exception):  # shutting down: nothing to recover
                registration.agent.deregister_memory(registration.handle)
        self._checksums.shutdown(wait=False)


def source_rows(cache: Any, src: list[int], heads: tuple[int, int]) -> np.ndarray:
    """The regions of heads [h0, h1) of blocks `src` of `cache`, every layer, in the order
    the decode worker's READ lands them (`cache[:, :, src, :, h0:h1]` in C order): runs of
    whole blocks where the heads are all the cache holds, one region per position otherwise."""
    planes, device_id = range(2 * cache.shape[0]), memory_type(cache)[1]
    if heads == (0, cache.shape[4]):
        starts, _, lengths = block_runs(src, src)
        return run_regions(
            cache.data_ptr(), device_id, cache.shape[2], planes, starts, lengths,
            cache[0, 0, 0].nbytes,
        )  # fmt: skip
    return position_regions(
        cache.data_ptr(), device_id, cache.shape[2], planes, np.asarray(src, dtype=np.int64),
        cache.shape[3], cache[0, 0, 0, 0].nbytes, heads, cache[0, 0, 0, 0, 0].nbytes,
    )  # fmt: skip
