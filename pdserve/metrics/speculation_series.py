"""Speculative decoding per worker (`pdserve_spec_*{worker}`, set by
`observe_worker_speculation`) and `speculation_delta`, the counts between two `WorkerStats`."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

# --- speculative decoding (decode workers; series exist once a worker has speculated) -----
SPEC_DRAFT_TOKENS = Counter(
    "pdserve_spec_draft_tokens",
    "Draft tokens a worker's target model verified (speculative decoding).",
    ["worker"],
)
SPEC_ACCEPTED_TOKENS = Counter(
    "pdserve_spec_accepted_tokens",
    "Draft tokens the target model accepted; acceptance rate = accepted / draft tokens.",
    ["worker"],
)
SPEC_VERIFY_STEPS = Counter(
    "pdserve_spec_verify_steps",
    "Verify steps: one per sequence per engine step that verified draft tokens; mean accepted "
    "tokens per step = accepted / verify steps.",
    ["worker"],
)
SPEC_ACCEPTANCE_RATIO = Gauge(
    "pdserve_spec_acceptance_ratio",
    "Share of a worker's draft tokens accepted since it started.",
    ["worker"],
)
SPEC_MEAN_ACCEPTED = Gauge(
    "pdserve_spec_mean_accepted_tokens",
    "Draft tokens accepted per verify step since the worker started (each step also adds the "
    "target's own token).",
    ["worker"],
)
SPEC_PAUSED = Gauge(
    "pdserve_spec_paused",
    "1 while a worker's speculation has switched itself off (its acceptance did not pay).",
    ["worker"],
)
# The WorkerStats counts behind each speculative decoding counter, in the same order.
SPEC_COUNT_FIELDS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")


def observe_worker_speculation(stats: Any, previous: Any | None) -> None:
    """Adds one worker's speculation since `previous` to its counters and sets its gauges."""
    worker = stats.worker_id
    counters = (SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS, SPEC_VERIFY_STEPS)
    for counter, amount in zip(counters, speculation_delta(previous, stats), strict=True):
        counter.labels(worker=worker).inc(amount)
    SPEC_ACCEPTANCE_RATIO.labels(worker=worker).set(
        stats.spec_accepted_tokens / max(stats.spec_draft_tokens, 1)
    )
    SPEC_MEAN_ACCEPTED.labels(worker=worker).set(
        stats.spec_accepted_tokens / stats.spec_verify_steps
    )
    SPEC_PAUSED.labels(worker=worker).set(stats.spec_paused)


def speculation_delta(previous: Any | None, stats: Any) -> tuple[int, ...]:
    """A worker's draft tokens, accepted tokens and verify steps between two snapshots of its
    `WorkerStats` (SPEC_COUNT_FIELDS); all of them when there is no earlier snapshot of the same
    epoch (the worker started, or restarted, since)."""
    fresh = previous is None or previous.epoch != stats.epoch
    return tuple(
        max(0, getattr(stats, name) - (0 if fresh else getattr(previous, name)))
        for name in SPEC_COUNT_FIELDS
    )
