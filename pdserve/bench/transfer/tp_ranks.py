"""The KV side of a tensor-parallel prefill worker and decode worker, in this process: each
rank's cache holds its heads of one reference (TP-1) cache, each decode rank serves its own
real KV endpoint, each prefill rank pushes with its own real sender (on nixl: each rank's
cache registered with its own agent, as every rank actor does). Rank 0 reaches the other
ranks by direct calls where the server uses Ray calls between rank actors
(pdserve/worker/rank_kv.py); everything else is the shipped code. `bench tp-handoff` measures
handoffs over it; tests/kv_transfer/ checks them over it at `SMALL_CACHE`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kv_transfer import CommitInfo, KVLayout, TransferResult, make_receiver, make_sender
from kv_transfer.tp_handoff import RankedReceiver, SlicedSend, push_own_heads, send_sliced
from pdserve.config import KVTransferConfig
from pdserve.models.tp_layout import kv_head_range


@dataclass(frozen=True)
class CacheShape:
    """A KV cache [layers, 2, blocks, block_size, kv_heads, head_dim] less its heads, which
    each rank splits."""

    layers: int
    blocks: int
    block_size: int
    head_dim: int

    def of(self, kv_heads: int) -> tuple[int, ...]:
        return (self.layers, 2, self.blocks, self.block_size, kv_heads, self.head_dim)


# Small enough for a test, with several layers and blocks.
SMALL_CACHE = CacheShape(layers=3, blocks=12, block_size=4, head_dim=8)


def reference_cache(kv_heads: int, seed: int = 7, shape: CacheShape = SMALL_CACHE) -> torch.Tensor:
    return torch.randn(shape.of(kv_heads), generator=torch.Generator().manual_seed(seed))


class RankCacheSink:
    """A decode rank's KV sink: writes received heads into its cache, records commits and
    expiries (as the decode worker's engine and reservation table would act on them)."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.commits: dict[str, CommitInfo] = {}
        self.expired: list[str] = []

    def write_kv(
        self,
        transfer_id: str,
        block_ids: list[int],
        layer_start: int,
        data: torch.Tensor,
        head_start: int,
    ) -> None:
        layers = slice(layer_start, layer_start + data.shape[0])
        heads = slice(head_start, head_start + data.shape[4])
        self.cache[layers, :, block_ids, :, heads] = data

    def on_commit(self, transfer_id: str, commit: CommitInfo) -> None:
        self.commits[transfer_id] = commit

    def on_expired(self, transfer_id: str) -> None:
        self.expired.append(transfer_id)


@dataclass
class DecodeRanks:
    """A TP-`size` decode worker's receivers; rank 0's is the RankedReceiver."""

    config: KVTransferConfig
    kv_heads: int
    size: int
    shape: CacheShape = SMALL_CACHE
    sinks: list[RankCacheSink] = field(default_factory=list)
    followers: list = field(default_factory=list)  # ranks 1.. receivers
    ranked: RankedReceiver | None = None

    def __post_init__(self) -> None:
        layouts = []
        for rank in range(self.size):
            first, end = kv_head_range(self.kv_heads, rank, self.size)
            cache = torch.zeros(self.shape.of(end - first))
            self.sinks.append(RankCacheSink(cache))
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
            tuple(endpoints),
            transfer_id,
            src,
            self.reference.shape[0],  # layers
            self.reference.shape[4],  # KV heads
            self.size,
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
