"""The KV side of a tensor-parallel prefill worker and decode worker, in this process: each
rank's cache holds its heads of one reference (TP-1) cache, each decode rank serves its own
real KV endpoint, each prefill rank pushes with its own real sender (on nixl: each rank's
cache registered with its own agent, as every rank actor does). Rank 0 reaches the other
ranks by direct calls where the server uses Ray calls between rank actors
(pdserve/worker/rank_kv.py); everything else is the shipped code."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kv_transfer import CommitInfo, KVLayout, TransferResult, make_receiver, make_sender
from kv_transfer.tp_handoff import RankedReceiver, SlicedSend, push_own_heads, send_sliced
from pdserve.config import KVTransferConfig
from pdserve.models.tp_layout import kv_head_range
from tests.kv_transfer.kv_helpers import TensorSink

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 12, 4, 8


def reference_cache(kv_heads: int, seed: int = 7) -> torch.Tensor:
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@dataclass
class DecodeRanks:
    """A TP-`size` decode worker's receivers; rank 0's is the RankedReceiver."""

    config: KVTransferConfig
    kv_heads: int
    size: int
    sinks: list[TensorSink] = field(default_factory=list)
    followers: list = field(default_factory=list)  # ranks 1.. receivers
    ranked: RankedReceiver | None = None

    def __post_init__(self) -> None:
        layouts = []
        for rank in range(self.size):
            first, end = kv_head_range(self.kv_heads, rank, self.size)
            cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, end - first, HEAD_DIM)
            self.sinks.append(TensorSink(cache))
            layouts.append(KVLayout.of(cache, first))
        for rank in range(1, self.size):
            receiver = make_receiver(
                self.config, self.sinks[rank], layouts[rank], self.sinks[rank].cache
            )
            receiver.start()
            self.followers.append(receiver)
        sink = RankedReceiver.sealing(self.sinks[0], self.call_followers)
        own = make_receiver(self.config, sink, layouts[0], self.sinks[0].cache)
        self.ranked = RankedReceiver(own, self.call_followers, [r.endpoint for r in self.followers])
        self.ranked.start()

    def call_followers(self, method: str, *args) -> list:
        return [getattr(receiver, method)(*args) for receiver in self.followers]

    def receivers(self) -> list:
        return [self.ranked.own, *self.followers]

    def stop(self) -> None:
        for receiver in self.receivers():
            receiver.stop()


@dataclass
class PrefillRanks:
    """A TP-`size` prefill worker's senders and caches (each its heads of `reference`)."""

    config: KVTransferConfig
    reference: torch.Tensor
    size: int
    senders: list = field(default_factory=list)
    caches: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        kv_heads = self.reference.shape[4]
        for rank in range(self.size):
            first, end = kv_head_range(kv_heads, rank, self.size)
            self.caches.append(self.reference[..., first:end, :].clone())
            self.senders.append(make_sender(self.config, self.caches[-1]))

    def hand_off(
        self, endpoints: list[str], transfer_id: str, src: list[int], commit: CommitInfo
    ) -> TransferResult:
        """Every rank pushes its heads (ranks > 0 on threads, as their actors would), rank 0
        commits: what the prefill worker's rank 0 runs (send_sliced)."""
        send = SlicedSend(
            tuple(endpoints), transfer_id, src, LAYERS, self.reference.shape[4], self.size
        )

        def start_followers():
            results: dict[int, TransferResult | BaseException] = {}

            def push(rank: int) -> None:
                try:
                    results[rank] = push_own_heads(
                        self.senders[rank], send, rank, self.caches[rank]
                    )
                except BaseException as exc:
                    results[rank] = exc

            threads = [threading.Thread(target=push, args=(r,)) for r in range(1, self.size)]
            for thread in threads:
                thread.start()

            def wait() -> list[TransferResult]:
                for thread in threads:
                    thread.join()
                for rank in range(1, self.size):
                    if isinstance(results[rank], BaseException):
                        raise results[rank]
                return [results[rank] for rank in range(1, self.size)]

            return wait

        return send_sliced(self.senders[0], send, self.caches[0], commit, start_followers)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
