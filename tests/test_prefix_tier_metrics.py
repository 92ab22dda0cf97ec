"""Prefix-cache hits per tier (pdserve_prefix_cache_hit_tokens_total{worker,tier}) and the host
tier's blocks (pdserve_kv_blocks{state="host"}), from the WorkerStats the router polls."""

from __future__ import annotations

from prometheus_client import REGISTRY

from pdserve import metrics
from pdserve.core.messages import WorkerStats


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def polled(epoch: int, hits: int, host_hits: int, host_cached: int) -> WorkerStats:
    return WorkerStats(
        "tier-test-0",
        "prefill",
        epoch,
        prefix_hit_tokens=hits,
        prefix_host_hit_tokens=host_hits,
        num_host_blocks=64,
        num_host_cached_blocks=host_cached,
    )


def test_hits_are_counted_per_tier_between_polls_and_across_a_restart() -> None:
    previous = None
    for stats in [polled(1, 0, 0, 0), polled(1, 96, 32, 10), polled(1, 160, 32, 12)]:
        metrics.observe_worker_stats(stats, previous)
        previous = stats
    metrics.observe_worker_stats(polled(2, 16, 16, 3), previous)  # restarted: epoch 2
    total = "pdserve_prefix_cache_hit_tokens_total"
    assert sample(total, worker="tier-test-0", tier="device") == 128
    assert sample(total, worker="tier-test-0", tier="host") == 48
    assert sample("pdserve_kv_blocks", worker="tier-test-0", state="host") == 3


def test_workers_without_a_host_tier_have_no_host_series() -> None:
    stats = WorkerStats("tier-test-1", "decode", 1, prefix_hit_tokens=8)
    metrics.observe_worker_stats(stats, None)
    assert sample("pdserve_kv_blocks", worker="tier-test-1", state="host") is None
    total = "pdserve_prefix_cache_hit_tokens_total"
    assert sample(total, worker="tier-test-1", tier="host") is None
    assert sample(total, worker="tier-test-1", tier="device") == 8


def test_disk_hits_and_blocks_have_their_own_series() -> None:
    stats = WorkerStats(
        "tier-test-2",
        "decode",
        1,
        prefix_hit_tokens=40,
        prefix_host_hit_tokens=8,
        prefix_disk_hit_tokens=24,
        num_host_blocks=4,
        num_disk_blocks=100,
        num_disk_cached_blocks=30,
    )
    metrics.observe_worker_stats(stats, None)
    total = "pdserve_prefix_cache_hit_tokens_total"
    assert sample(total, worker="tier-test-2", tier="device") == 8
    assert sample(total, worker="tier-test-2", tier="host") == 8
    assert sample(total, worker="tier-test-2", tier="disk") == 24
    assert sample("pdserve_kv_blocks", worker="tier-test-2", state="disk") == 30


def test_peer_hits_and_pulls_have_their_own_series() -> None:
    def pulled(hits: int, peer: int, started: int, committed: int, fallen_back: int):
        return WorkerStats(
            "tier-test-3",
            "decode",
            1,
            prefix_hit_tokens=hits,
            prefix_peer_hit_tokens=peer,
            peer_pulls_started=started,
            peer_pulls_committed=committed,
            peer_pulls_fallen_back=fallen_back,
        )

    first, second = pulled(40, 32, 2, 1, 1), pulled(100, 80, 3, 2, 1)
    metrics.observe_worker_stats(first, None)
    metrics.observe_worker_stats(second, first)
    total = "pdserve_prefix_cache_hit_tokens_total"
    assert sample(total, worker="tier-test-3", tier="peer") == 80
    assert sample(total, worker="tier-test-3", tier="device") == 20
    pulls = "pdserve_peer_pulls_total"
    assert sample(pulls, worker="tier-test-3", outcome="started") == 3
    assert sample(pulls, worker="tier-test-3", outcome="committed") == 2
    assert sample(pulls, worker="tier-test-3", outcome="fallen_back") == 1
