"""The router's request series: latency (`TTFT_SECONDS`, `TPOT_SECONDS`, `ITL_SECONDS`,
`E2E_SECONDS`), outcomes and routing (`REQUESTS`, `ROUTING_DECISIONS`, `PREFIX_HIT_TOKENS`,
`PREFIX_QUERY_TOKENS`), the requests it holds (`ROUTER_PENDING`, `track_router_pending`) and
its event loop's stalls (`ROUTER_LOOP_STALL_SECONDS`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from pdserve.metrics.buckets import E2E_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS

# --- request latency (router) --------------------------------------------------------------
TTFT_SECONDS = Histogram(
    "pdserve_ttft_seconds", "Time from request arrival to its first token.", buckets=TTFT_BUCKETS
)
TPOT_SECONDS = Histogram(
    "pdserve_tpot_seconds",
    "Mean time per output token after the first, one sample per request.",
    buckets=TOKEN_BUCKETS,
)
ITL_SECONDS = Histogram(
    "pdserve_itl_seconds",
    "Time between consecutive token-carrying responses seen by the client, one sample per "
    "response (vLLM's definition; a response may carry several tokens).",
    buckets=TOKEN_BUCKETS,
)
E2E_SECONDS = Histogram(
    "pdserve_e2e_seconds", "Time from request arrival to its last token.", buckets=E2E_BUCKETS
)

# --- requests and routing (router) ---------------------------------------------------------
REQUESTS = Counter(
    "pdserve_requests_total",
    "Finished requests by outcome: stop, length, abort, cancelled, rejected, error.",
    ["outcome"],
)
ROUTING_DECISIONS = Counter(
    "pdserve_routing_decisions_total",
    "Routing decisions, one per attempt: remote (prefill worker + KV transfer), local (decode "
    "worker prefills), rejected (admission control), unavailable (no healthy worker).",
    ["decision"],
)
ROUTER_PENDING = Gauge(
    "pdserve_router_pending",
    "Requests the router holds, by stage: workers (in flight on them), tokenize and "
    "request_body (jobs running or queued in its CPU pools), waiting_for_room (between "
    "attempts, the workers full). Admission control refuses a new request while their sum is "
    "max_pending_requests.",
    ["stage"],
)
PREFIX_HIT_TOKENS = Counter(
    "pdserve_prefix_hit_tokens_total", "Prompt tokens found in the chosen worker's prefix cache."
)
PREFIX_QUERY_TOKENS = Counter(
    "pdserve_prefix_query_tokens_total",
    "Prompt tokens looked up in the prefix index; hit rate = hit / query.",
)
ROUTER_LOOP_STALL_SECONDS = Counter(
    "pdserve_router_loop_stall_seconds_total",
    "Seconds the router's event loop woke late (CPU throttling, a long GC, a starved host). "
    "Workers' silence over this time is not held against them (router/loop_lag.py).",
)


def track_router_pending(stages: Mapping[str, Callable[[], int]]) -> None:
    """`pdserve_router_pending` read from the router's live counts at each scrape."""
    for stage, count in stages.items():
        ROUTER_PENDING.labels(stage=stage).set_function(count)
