"""What ServingApp does with every worker's stats as the pool polls them: the Prometheus series
(the router's endpoint shows every worker's) and the speculation counts `pdserve stats` reads."""

from __future__ import annotations

from pdserve import metrics
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.spec_stats import record_speculation
from router.worker_pool import WorkerPool


def export_worker_stats(pool: WorkerPool, model: str, speculates: bool) -> None:
    """Each worker's gauges and counters, and the served model's load and speculative decoding
    under vLLM's names, from the latest poll; the router's event-loop stalls."""
    pool.stats_listeners.append(lambda w, old, stats: metrics.observe_worker_stats(stats, old))
    pool.loop_lag.listeners.append(metrics.ROUTER_LOOP_STALL_SECONDS.inc)
    # The speculation counters exist (at 0) from the start when the decode pool speculates, as
    # vLLM's do.
    if speculates:
        for counter in metrics.MODEL_SPEC_COUNTERS:
            counter.labels(model)
    pool.stats_listeners.append(
        lambda w, old, stats: metrics.observe_model_speculation(model, old, stats)
    )
    # The served model's load under vLLM's names (vllm:num_requests_running, ...).
    pool.stats_listeners.append(
        lambda w, old, stats: metrics.observe_model_load(
            model, [x.stats for x in pool.workers.values() if x.stats]
        )
    )


def store_speculation_counts(pool: WorkerPool, index: PrefixIndex) -> None:
    """`pdserve stats` reads the speculation counts from the index's Redis (written off the
    event loop, which runs the pool's polls)."""

    def speculation_counts(worker, old, stats) -> None:
        counts = metrics.speculation_delta(old, stats)
        if any(counts):
            args = (index.link, index.keys, worker.worker_id, counts)
            index.in_background(record_speculation, *args)

    pool.stats_listeners.append(speculation_counts)
