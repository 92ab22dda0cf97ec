"""The splits of a cluster the search compares (`all_splits`, `tp_splits`) and the replicas one is
simulated as (`replica_count`, `simulated_workers`: what a probe of it costs)."""

from __future__ import annotations

import math

from pdserve.planner.probe import Split


def all_splits(workers: int) -> list[Split]:
    """Colocated over every worker, and every P:D with P + D = workers."""
    return [Split(0, workers)] + [Split(p, workers - p) for p in range(1, workers)]


def tp_splits(gpus: int, prefill_tps: list[int], decode_tps: list[int]) -> list[Split]:
    """Every way to serve on `gpus` GPUs with each pool at one of its TPs: colocated at each
    decode TP that divides them, and every P prefill workers of TP p with D decode workers of
    TP d that use them all (P x p + D x d = gpus, P and D at least 1). A colocated worker
    prefills at its own TP, so its split carries d for both pools (the search times each
    split by its pair of TPs)."""
    splits = [Split(0, gpus // d, d, d) for d in sorted(set(decode_tps)) if gpus % d == 0]
    for p in sorted(set(prefill_tps)):
        for d in sorted(set(decode_tps)):
            splits += [
                Split(n, (gpus - n * p) // d, p, d)
                for n in range(1, gpus // p)
                if (gpus - n * p) % d == 0 and gpus - n * p >= d
            ]
    return splits


def replica_count(split: Split, min_workers: int) -> int:
    """The most identical replicas `split` divides into, each of at least `min_workers`."""
    common = math.gcd(split.prefill, split.decode)
    workers = split.prefill + split.decode
    fits = [k for k in range(1, common + 1) if common % k == 0 and workers // k >= min_workers]
    return max(fits, default=1)


def simulated_workers(split: Split, replicas: int) -> int:
    """Workers one probe of `split` simulates (one of its replicas): what a probe costs."""
    return (split.prefill + split.decode) // replicas
