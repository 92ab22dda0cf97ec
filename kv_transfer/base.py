"""The KV-transfer seam: what a prefill worker sends with and what a decode worker receives with.

Three transports implement it (grpc, collective, nixl) with the same reservation/commit/abort
semantics; `kv_transfer.factory` picks one from `KVTransferConfig.transport`.

Tensor layout everywhere: a chunk of KV is `[l1 - l0, 2, n, block_size, num_kv_heads, head_dim]`
(layers l0..l1 of n blocks; 2 = K, V), i.e. `kv_cache[l0:l1, :, block_ids]` of the engine's
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` cache.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# read_kv(src_block_ids, layer_start, layer_end) -> [l1-l0, 2, n, block_size, heads, head_dim]
ReadKV = Callable[[list[int], int, int], "torch.Tensor"]


class KVTransferError(Exception):
    """A transfer failed (peer gone, rejected, checksum, deadline). The caller aborts and retries."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of one decode worker's KV cache, so the receiver can reject mismatched chunks."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name: "float32", "bfloat16", "float16"
    device: str = "cpu"  # where the cache lives; "cuda..." selects NCCL in the collective transport
    # The model's index of the cache's first KV head: a tensor-parallel rank's cache holds
    # heads [first_kv_head, first_kv_head + num_kv_heads) of the model (0 on one device).
    first_kv_head: int = 0

    @classmethod
    def of(cls, kv_cache: torch.Tensor, first_kv_head: int = 0) -> KVLayout:
        """Layout of an engine cache `[num_layers, 2, num_blocks, block_size, heads, head_dim]`."""
        num_layers, _, _, block_size, heads, head_dim = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        device = str(kv_cache.device)
        return cls(num_layers, block_size, heads, head_dim, dtype, device, first_kv_head)


@dataclass(frozen=True)
class CommitInfo:
    """What decode needs to continue a prefilled request."""

    first_token_id: int
    first_logprob: float | None = None
    num_prompt_tokens: int = 0
    # W3C trace context (`traceparent`, `tracestate`). On the receiver, the one the commit carried.
    trace_context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TransferRequest:
    """One push of blocks from a prefill worker into a decode worker's reservation."""

    endpoint: str  # the receiver's "host:port", as returned by KVReceiver.start()
    transfer_id: str  # issued by KVReceiver.open()
    src_block_ids: list[int]  # prefill-side blocks, in the order of the reservation's blocks
    num_layers: int
    read_kv: ReadKV  # e.g. LLMEngine.read_kv
    # None: push only. A tensor-parallel handoff pushes each rank's heads, then commits once.
    commit: CommitInfo | None
    trace_context: dict[str, str] = field(default_factory=dict)  # sent in every chunk header
    timeout_s: float | None = None  # bound on the whole send; None = config reservation timeout
    kv_head_start: int = 0  # the model's index of the first KV head read_kv returns
    # The source cache's own indices [h0, h1) of the heads read_kv returns (None: every head):
    # where the nixl transport, which reads the cache in place rather than through read_kv,
    # finds them.
    src_heads: tuple[int, int] | None = None


@dataclass(frozen=True)
class TransferResult:
    """What a successful send moved."""

    bytes: int
    chunks: int
    seconds: float
    # A tensor-parallel handoff: the payload bytes each prefill rank sent, in rank order.
    rank_bytes: tuple[int, ...] = ()
    # nixl: the descriptors its READs took (each side); 0 on the other transports.
    descriptors: int = 0


class KVSink(Protocol):
    """Implemented by the decode worker: where received KV goes and who owns the blocks.

    Calls come from the receiver's own threads (never the engine thread or the event loop).
    For one transfer: any number of `write_kv`, then exactly one of `on_commit` or `on_expired`,
    or neither if the worker itself called `KVReceiver.abort`. After `on_expired` or a returned
    `KVReceiver.abort`, `write_kv` is never called for that transfer again (fencing), so the
    worker may free and reuse its blocks at once.
    """

    def write_kv(
        self,
        transfer_id: str,
        block_ids: list[int],
        layer_start: int,
        data: torch.Tensor,
        head_start: int,
    ) -> None:
        """Copies `data` ([l1-l0, 2, n, block_size, h, head_dim]) of transfer `transfer_id`
        (the id every chunk carries) into `kv_cache[l0:l1, :, block_ids]`'s heads
        [head_start, head_start + h) (the cache's own indices; h = all of them but on a
        tensor-parallel handoff)."""

    def on_commit(self, transfer_id: str, commit: CommitInfo) -> None:
        """Every block arrived; start decoding. Raise to fail the commit (the sender sees it):
        ValueError when a field of `commit` does not fit the reservation (INVALID_ARGUMENT),
        anything else when the request cannot continue here (FAILED_PRECONDITION)."""

    def on_expired(self, transfer_id: str) -> None:
        """The transfer ended without commit (deadline passed, remote abort, bad chunk, failed
        commit): free its reservation."""


class KVReceiver(abc.ABC):
    """Decode side: issues transfer ids for reserved blocks and writes arriving KV into the sink.

    Contract: only blocks of an OPEN reservation are ever written; chunks or commits for unknown,
    expired, aborted, failed or committed ids are rejected; every chunk's checksum, dtype and
    shape are verified before `write_kv`; a reservation not committed by its deadline is expired
    (sink.on_expired) — nothing waits forever and no blocks leak. Thread-safe.
    """

    @abc.abstractmethod
    def start(self) -> str:
        """Starts serving; returns the endpoint ("host:port") senders dial."""

    @abc.abstractmethod
    def open(
        self,
        dest_block_ids: list[int],
        deadline_s: float | None = None,
        trace_context: dict[str, str] | None = None,
        transfer_id: str | None = None,
    ) -> str:
        """Reserves a transfer into `dest_block_ids` that expires `deadline_s` seconds from now
        (None = config.reservation_timeout_s); returns its unguessable transfer id, or
        `transfer_id` when given (the id rank 0 of a tensor-parallel decode worker issued)."""

    @abc.abstractmethod
    def abort(self, transfer_id: str) -> bool:
        """Fences the transfer; True if it was open. Idempotent. No callback to the sink: the
        caller frees the blocks itself. On return no write into its blocks is in progress."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stops serving; open transfers are left to their owner (it is shutting down too)."""


class KVSender(abc.ABC):
    """Prefill side: pushes the blocks of a TransferRequest in chunks, then commits. Thread-safe;
    one sender serves many concurrent transfers to many receivers."""

    @abc.abstractmethod
    def send(self, request: TransferRequest) -> TransferResult:
        """Pushes every layer of every block, then commits (unless `request.commit` is None).
        Raises KVTransferError on any failure; the caller aborts the transfer (both sides) and
        retries elsewhere."""

    @abc.abstractmethod
    def abort(self, endpoint: str, transfer_id: str) -> None:
        """Asks the receiver to fence the transfer and free its blocks. Idempotent; never raises
        for unknown ids or an unreachable receiver (the deadline frees the blocks then)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Closes connections to every receiver."""
