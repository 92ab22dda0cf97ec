"""Mixture-of-experts load per worker (`EXPERT_TOKENS{worker,expert}`,
`EXPERT_LOAD_IMBALANCE{worker}`, set by `observe_expert_load`) and `expert_load`, a worker's
per-layer counts summed."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

# --- mixtures of experts (router and worker) -----------------------------------------------
EXPERT_TOKENS = Counter(
    "pdserve_expert_tokens",
    "Tokens routed to each expert of a mixture-of-experts worker, summed over its sparse layers "
    "(expert: the expert's index).",
    ["worker", "expert"],
)
EXPERT_LOAD_IMBALANCE = Gauge(
    "pdserve_expert_load_imbalance",
    "Tokens of a worker's busiest (layer, expert) over the mean since it started (1 = even).",
    ["worker"],
)


def observe_expert_load(stats: Any, previous: Any | None) -> None:
    """Adds one worker's routed tokens since `previous` to its counters; sets its imbalance."""
    before = previous.expert_tokens if previous is not None else []
    if previous is None or previous.epoch != stats.epoch or len(before) != len(stats.expert_tokens):
        before = [0] * len(stats.expert_tokens)
    for expert, (now, then) in enumerate(zip(stats.expert_tokens, before, strict=True)):
        if now > then:
            EXPERT_TOKENS.labels(worker=stats.worker_id, expert=str(expert)).inc(now - then)
    EXPERT_LOAD_IMBALANCE.labels(worker=stats.worker_id).set(stats.expert_load_imbalance)


def expert_load(per_layer: list[list[int]]) -> tuple[list[int], float]:
    """Tokens per expert summed over the sparse layers, and the busiest (layer, expert)'s
    tokens over the mean (0 before any token was routed)."""
    per_expert = [sum(column) for column in zip(*per_layer, strict=True)]
    cells = [n for layer in per_layer for n in layer]
    if not any(cells):
        return per_expert, 0.0
    return per_expert, max(cells) * len(cells) / sum(cells)
