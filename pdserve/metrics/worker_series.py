"""A worker's series (`QUEUE_LENGTH`, `KV_BLOCKS{worker,state}`, `PREFIX_CACHE_HIT_TOKENS`
by KV tier or peer, `PEER_PULLS{worker,outcome}`, `WORKER_PEAK_MEMORY`, `PREFIX_HIT_RATIO`), all
set from its `WorkerStats` by `observe_worker_stats` (with its speculation and expert series),
and `prefix_hit_delta`."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

from pdserve.core.kv_events import KV_TIERS
from pdserve.metrics.expert_series import observe_expert_load
from pdserve.metrics.speculation_series import observe_worker_speculation

QUEUE_LENGTH = Gauge(
    "pdserve_queue_length", "Requests waiting in a worker's scheduler queue.", ["worker"]
)
KV_BLOCKS = Gauge(
    "pdserve_kv_blocks",
    "KV cache blocks of a worker by state: used, free (device pool), host (prefix-cache blocks "
    "kept in host memory, --kv-offload-gb), disk (kept in files, --kv-disk-dir).",
    ["worker", "state"],
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "pdserve_prefix_cache_hit_tokens",
    "Prompt tokens a worker found in its prefix cache, by tier: device (its KV pool), host "
    "(brought back from host memory instead of recomputed), disk (read back from a file) or "
    "peer (pulled from another worker's cache, --peer-pull).",
    ["worker", "tier"],
)
# Where a hit came from: the KV tiers of the worker's own cache, then another worker's.
HIT_TIERS = (*KV_TIERS, "peer")
PEER_PULLS = Counter(
    "pdserve_peer_pulls",
    "Peer pulls into a worker (--peer-pull), by outcome: started (reserved), committed (the "
    "prefix arrived) or fallen_back (it did not: the worker prefilled it).",
    ["worker", "outcome"],
)
_PULL_OUTCOMES = {
    "started": "peer_pulls_started",
    "committed": "peer_pulls_committed",
    "fallen_back": "peer_pulls_fallen_back",
}
WORKER_PEAK_MEMORY = Gauge(
    "pdserve_worker_peak_memory_bytes",
    "Peak memory of a worker process since it started, by kind: rss (resident set), gpu (CUDA "
    "allocator; 0 on CPU).",
    ["worker", "kind"],
)
PREFIX_HIT_RATIO = Gauge(
    "pdserve_prefix_hit_ratio",
    "Share of a worker's prompt tokens found in its prefix cache since it started.",
    ["worker"],
)


def observe_worker_stats(stats: Any, previous: Any | None = None) -> None:
    """Sets the gauges of one worker from its `WorkerStats` (cheap: a few dict lookups), and
    adds to its counters what happened since `previous`, its snapshot before this one."""
    worker = stats.worker_id
    QUEUE_LENGTH.labels(worker=worker).set(stats.num_waiting)
    KV_BLOCKS.labels(worker=worker, state="used").set(stats.num_used_blocks)
    KV_BLOCKS.labels(worker=worker, state="free").set(stats.num_free_blocks)
    if stats.num_host_blocks:
        KV_BLOCKS.labels(worker=worker, state="host").set(stats.num_host_cached_blocks)
    if stats.num_disk_blocks:
        KV_BLOCKS.labels(worker=worker, state="disk").set(stats.num_disk_cached_blocks)
    for tier, amount in zip(HIT_TIERS, prefix_hit_delta(previous, stats), strict=True):
        if amount:
            PREFIX_CACHE_HIT_TOKENS.labels(worker=worker, tier=tier).inc(amount)
    fresh = previous is None or previous.epoch != stats.epoch
    for outcome, name in _PULL_OUTCOMES.items():
        pulls = getattr(stats, name) - (0 if fresh else getattr(previous, name))
        if pulls > 0:
            PEER_PULLS.labels(worker=worker, outcome=outcome).inc(pulls)
    WORKER_PEAK_MEMORY.labels(worker=worker, kind="rss").set(stats.peak_rss_bytes)
    WORKER_PEAK_MEMORY.labels(worker=worker, kind="gpu").set(stats.peak_gpu_bytes)
    if stats.prefix_query_tokens:
        ratio = stats.prefix_hit_tokens / stats.prefix_query_tokens
        PREFIX_HIT_RATIO.labels(worker=worker).set(ratio)
    if stats.spec_verify_steps:
        observe_worker_speculation(stats, previous)
    if stats.expert_tokens:
        observe_expert_load(stats, previous)


def prefix_hit_delta(previous: Any | None, stats: Any) -> tuple[int, int, int, int]:
    """A worker's prefix-cache hit tokens in the device, the host and the disk tier and those
    pulled from peers (HIT_TIERS) between two snapshots of its `WorkerStats` (all of them after
    a start or restart)."""
    fresh = previous is None or previous.epoch != stats.epoch

    def delta(name: str) -> int:
        return getattr(stats, name) - (0 if fresh else getattr(previous, name))

    host, disk = delta("prefix_host_hit_tokens"), delta("prefix_disk_hit_tokens")
    peer = delta("prefix_peer_hit_tokens")
    device = delta("prefix_hit_tokens") - host - disk - peer
    return max(0, device), max(0, host), max(0, disk), max(0, peer)
