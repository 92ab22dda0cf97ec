"""Speculative decoding statistics kept in Redis beside the reuse counters: draft tokens the
target verified, draft tokens it accepted, and verify steps, per decode worker and model.

The router adds each worker's counts since its previous stats poll (`record_speculation`, from
the WorkerStats it polls); `pdserve stats` reads them with `read_speculation_stats`. Layout: the
HASH `speculation_key(keys)` with `draft_tokens`, `accepted_tokens`, `verify_steps` and
`w:<worker>:<counter>` (see pdserve/prefix_index/schema.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from pdserve.prefix_index.redis_link import RedisLink
from pdserve.prefix_index.reuse_stats import PerWorkerCounts, fill_counts, text_of
from pdserve.prefix_index.schema import IndexKeys

COUNTERS = ("draft_tokens", "accepted_tokens", "verify_steps")


@dataclass
class SpecCounts:
    draft_tokens: int = 0  # draft tokens the target verified
    accepted_tokens: int = 0  # of them, accepted
    verify_steps: int = 0  # one per sequence per step that verified draft tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per verify step (the step adds the target's own token)."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            **{name: getattr(self, name) for name in COUNTERS},
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted": round(self.mean_accepted, 4),
        }


@dataclass
class ModelSpeculation(PerWorkerCounts):
    total: SpecCounts = field(default_factory=SpecCounts)


def speculation_key(keys: IndexKeys) -> str:
    return keys.base + "spec"


def record_speculation(
    link: RedisLink, keys: IndexKeys, worker_id: str, counts: Sequence[int]
) -> None:
    """Adds a worker's draft tokens, accepted tokens and verify steps (in COUNTERS' order);
    never raises (an unreachable Redis loses these counts, as it does reuse counts)."""
    if not any(counts):
        return

    def add(client: redis.Redis) -> None:
        pipe = client.pipeline(transaction=False)
        key = speculation_key(keys)
        for counter, amount in zip(COUNTERS, counts, strict=True):
            pipe.hincrby(key, counter, amount)
            pipe.hincrby(key, f"w:{worker_id}:{counter}", amount)
        pipe.sadd(keys.models, keys.model)
        pipe.execute()

    link.call(add, None)


def read_speculation_stats(
    client: redis.Redis, models: Sequence[str], namespace: str = "pdserve"
) -> dict[str, ModelSpeculation]:
    """The statistics of each of `models` that has any. Raises redis errors (the CLI reports
    them)."""
    result = {}
    for model in models:
        fields = client.hgetall(speculation_key(IndexKeys(model, namespace)))
        if fields:
            result[model] = _parse(model, {text_of(k): text_of(v) for k, v in fields.items()})
    return result


def _parse(model: str, fields: dict[str, str]) -> ModelSpeculation:
    return fill_counts(ModelSpeculation(model), fields, COUNTERS, SpecCounts)
