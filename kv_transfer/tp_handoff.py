"""A KV handoff between tensor-parallel workers: every rank moves its own heads, rank to rank.

Each rank of a TP worker holds only its KV heads (kv_transfer/head_slices.py says which), so
nothing is gathered to or scattered from rank 0:
- Decode: every rank serves its own KV endpoint; its receiver's layout names the heads its
  cache holds. Rank 0 (`RankedReceiver`) opens the same transfer id on every rank, with the
  same blocks (rank 0's block manager allocates for all ranks) and deadline; a reservation
  names every rank's endpoint (`KVReservation.rank_endpoints`). The commit arrives at rank 0
  only, and goes through only once every other rank sealed its part (every layer of its heads
  arrived; a sealed part takes no more writes). Any end without commit — abort, deadline,
  failed chunk or refused commit — fences every rank's part before rank 0's sink frees the
  blocks, so no rank writes into blocks that are reused.
- Prefill: every rank pushes its heads' parts straight to the decode ranks holding them
  (`push_own_heads`, push only); rank 0 waits for all of them, then commits on decode rank 0
  (`send_sliced`).
How rank 0 reaches the other ranks is the caller's: Ray calls between a worker's rank actors
(pdserve/worker/rank_kv.py), direct calls in the transfer tests.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kv_transfer.base import (
    CommitInfo,
    KVReceiver,
    KVSender,
    KVSink,
    TransferRequest,
    TransferResult,
)
from kv_transfer.head_slices import read_heads, slices_to_send
from pdserve.models.tp_layout import kv_head_range

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# FollowerCalls(method, *args): calls `method` ("open", "seal" or "abort", with a receiver's
# arguments) on every other rank's receiver; returns their answers, raising the first error.
FollowerCalls = Callable[..., list[Any]]


class _SealingSink:
    """Rank 0's sink: commits only once every other rank sealed its part; fences every other
    rank's part before the decode worker learns a transfer ended without commit."""

    def __init__(self, sink: KVSink, followers: FollowerCalls) -> None:
        self._sink = sink
        self._followers = followers

    def write_kv(
        self, transfer_id: str, block_ids: list[int], layer_start: int, data: Any, head_start: int
    ) -> None:
        self._sink.write_kv(transfer_id, block_ids, layer_start, data, head_start)

    def on_commit(self, transfer_id: str, commit: CommitInfo) -> None:
        self._followers("seal", transfer_id)  # raises: the commit is refused, the transfer fails
        self._sink.on_commit(transfer_id, commit)

    def on_expired(self, transfer_id: str) -> None:
        fence(self._followers, transfer_id)
        self._sink.on_expired(transfer_id)


def fence(followers: FollowerCalls, transfer_id: str) -> None:
    """Aborts every other rank's part; a rank that cannot be reached is going down with its
    worker (its group broke), so there is nothing left to fence there."""
    try:
        followers("abort", transfer_id)
    except Exception:
        log.exception("fencing transfer %s on the other ranks failed", transfer_id)


class RankedReceiver(KVReceiver):
    """Decode rank 0's receiver: its own heads on its own endpoint (`own`, built over the sink
    `sealing(sink)` returns), and every other rank's part opened, sealed and aborted with it."""

    def __init__(
        self, own: KVReceiver, followers: FollowerCalls, follower_endpoints: list[str]
    ) -> None:
        self.own = own
        self._followers = followers
        self._follower_endpoints = list(follower_endpoints)

    @staticmethod
    def sealing(sink: KVSink, followers: FollowerCalls) -> KVSink:
        return _SealingSink(sink, followers)

    @property
    def endpoints(self) -> list[str]:
        """Every rank's KV endpoint, in rank order (after start())."""
        return [self.own.endpoint, *self._follower_endpoints]

    def start(self) -> str:
        return self.own.start()

    def open(
        self,
        dest_block_ids: list[int],
        deadline_s: float | None = None,
        trace_context: dict[str, str] | None = None,
        transfer_id: str | None = None,
    ) -> str:
        transfer_id = self.own.open(dest_block_ids, deadline_s, trace_context, transfer_id)
        try:
            self._followers("open", dest_block_ids, deadline_s, trace_context, transfer_id)
        except BaseException:
            self.abort(transfer_id)
            raise
        return transfer_id

    def abort(self, transfer_id: str) -> bool:
        was_open = self.own.abort(transfer_id)
        fence(self._followers, transfer_id)
        return was_open

    def stop(self) -> None:
        self.own.stop()

    def open_transfer_ids(self) -> list[str]:
        return self.own.open_transfer_ids()


@dataclass(frozen=True)
class SlicedSend:
    """One handoff as every prefill rank sees it (picklable: it goes to the other ranks)."""

    endpoints: tuple[str, ...]  # every decode rank's KV endpoint, in rank order
    transfer_id: str
    src_block_ids: list[int]
    num_layers: int
    total_kv_heads: int  # the model's
    prefill_tp: int
    trace_context: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None


def push_own_heads(
    sender: KVSender, send: SlicedSend, rank: int, kv_cache: torch.Tensor
) -> TransferResult:
    """Prefill rank `rank` pushes (no commit) its part of every decode rank's heads, read from
    its own cache (which holds its heads only)."""
    started = time.perf_counter()
    own_first = kv_head_range(send.total_kv_heads, rank, send.prefill_tp)[0]
    nbytes = chunks = descriptors = 0
    decode_tp = len(send.endpoints)
    for part in slices_to_send(send.total_kv_heads, rank, send.prefill_tp, decode_tp):
        heads = (part.first_head - own_first, part.end_head - own_first)

        def read(ids: list[int], l0: int, l1: int, heads: tuple[int, int] = heads) -> Any:
            return read_heads(kv_cache, ids, (l0, l1), heads)

        sent = sender.send(
            TransferRequest(
                endpoint=send.endpoints[part.decode_rank],
                transfer_id=send.transfer_id,
                src_block_ids=send.src_block_ids,
                num_layers=send.num_layers,
                read_kv=read,
                commit=None,
                trace_context=send.trace_context,
                timeout_s=send.timeout_s,
                kv_head_start=part.first_head,
                src_heads=heads,
            )
        )
        nbytes += sent.bytes
        chunks += sent.chunks
        descriptors += sent.descriptors
    seconds = time.perf_counter() - started
    return TransferResult(nbytes, chunks, seconds, descriptors=descriptors)


def send_sliced(
    sender: KVSender,
    send: SlicedSend,
    kv_cache: torch.Tensor,
    commit: CommitInfo,
    start_followers: Callable[[], Callable[[], list[TransferResult]]],
) -> TransferResult:
    """Prefill rank 0: starts the other ranks' pushes (`start_followers()` returns what waits
    for their results), pushes its own, and commits on decode rank 0 once every rank's push
    returned. Raises like KVSender.send; the caller aborts the transfer on decode rank 0,
    which fences every decode rank."""
    started = time.perf_counter()
    wait_followers = start_followers()
    try:
        own = push_own_heads(sender, send, 0, kv_cache)
    except BaseException:
        with contextlib.suppress(Exception):  # their pushes fail too once the transfer ends
            wait_followers()
        raise
    theirs = wait_followers()
    sender.send(
        TransferRequest(
            endpoint=send.endpoints[0],
            transfer_id=send.transfer_id,
            src_block_ids=[],  # every rank pushed its heads: only the commit is left
            num_layers=send.num_layers,
            read_kv=lambda *_: None,
            commit=commit,
            trace_context=send.trace_context,
            timeout_s=send.timeout_s,
        )
    )
    rank_bytes = (own.bytes, *(result.bytes for result in theirs))
    chunks = own.chunks + sum(result.chunks for result in theirs)
    descriptors = own.descriptors + sum(result.descriptors for result in theirs)
    seconds = time.perf_counter() - started
    return TransferResult(sum(rank_bytes), chunks, seconds, rank_bytes, descriptors)
