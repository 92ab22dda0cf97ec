"""Prefix-cache reuse statistics kept in Redis: hit and miss prompt tokens per worker and model.

The router adds to them after each routing decision (`PrefixIndex.record_reuse`); `pdserve stats`
reads them with `read_reuse_stats`. Layout: see pdserve/prefix_index/schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from pdserve.prefix_index.schema import IndexKeys

COUNTERS = ("hit_tokens", "miss_tokens", "requests")


@dataclass
class ReuseCounts:
    hit_tokens: int = 0  # prompt tokens served from a worker's prefix cache
    miss_tokens: int = 0  # prompt tokens that had to be computed
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "requests": self.requests,
            "hit_rate": round(self.hit_rate, 4),
        }


@dataclass
class PerWorkerCounts:
    """One model's counts (any counts class with `as_dict`): its total and each worker's."""

    model: str
    total: Any
    workers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            **self.total.as_dict(),
            "workers": {w: c.as_dict() for w, c in sorted(self.workers.items())},
        }


@dataclass
class ModelReuse(PerWorkerCounts):
    total: ReuseCounts = field(default_factory=ReuseCounts)


def add_reuse(pipe: redis.client.Pipeline, keys: IndexKeys, worker_id: str, hit: int, miss: int):
    """Queues the increments of one request on `pipe` (the caller executes it)."""
    increments = {"hit_tokens": hit, "miss_tokens": miss, "requests": 1}
    for counter, amount in increments.items():
        pipe.hincrby(keys.reuse, counter, amount)
        pipe.hincrby(keys.reuse, f"w:{worker_id}:{counter}", amount)
    pipe.sadd(keys.models, keys.model)


def parse_reuse(model: str, fields: dict[str, str]) -> ModelReuse:
    """A `reuse` hash (HGETALL) as counts per model and per worker."""
    return fill_counts(ModelReuse(model), fields, COUNTERS, ReuseCounts)


def fill_counts(stats, fields: dict[str, str], counters: tuple[str, ...], new_counts):
    """Fills `stats` (a PerWorkerCounts) from a hash of `counter` and `w:<worker>:<counter>`
    fields (the layout of the reuse and speculation hashes); returns it."""
    for name, value in fields.items():
        if name in counters:
            setattr(stats.total, name, int(value))
        elif name.startswith("w:"):
            worker_id, _, counter = name[2:].rpartition(":")
            if counter in counters:
                setattr(stats.workers.setdefault(worker_id, new_counts()), counter, int(value))
    return stats


def read_reuse_stats(
    client: redis.Redis, namespace: str = "pdserve", model: str | None = None
) -> dict[str, ModelReuse]:
    """Statistics of `model`, or of every model that has any. Raises redis errors (the CLI
    reports them); the router reads through PrefixIndex.stats, which does not."""
    if model is not None:
        models = [model]
    else:
        models = sorted(text_of(m) for m in client.smembers(IndexKeys("_", namespace).models))
    result: dict[str, ModelReuse] = {}
    for name in models:
        fields = client.hgetall(IndexKeys(name, namespace).reuse)
        result[name] = parse_reuse(name, {text_of(k): text_of(v) for k, v in fields.items()})
    return result


def text_of(value: str | bytes) -> str:
    """A Redis reply as text (clients without decode_responses answer bytes)."""
    return value.decode() if isinstance(value, bytes) else value
