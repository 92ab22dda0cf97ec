"""The Prometheus metrics of pdserve, defined once so every process names them the same.

Each process has its own default registry; the router exports the request-level metrics
and the per-worker gauges (filled from worker stats), and any process may serve its own
registry with `start_metrics_server`. Label values used across the code base are listed in
each metric's help text; keep them to those few values (label cardinality is memory).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

# Latency buckets in seconds: TTFT spans queueing and long prompts; per-token times are ms.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30)

# --- request latency (router) --------------------------------------------------------------
TTFT_SECONDS = Histogram(
    "pdserve_ttft_seconds", "Time from request arrival to its first token.", buckets=_TTFT_BUCKETS
)
TPOT_SECONDS = Histogram(
    "pdserve_tpot_seconds",
    "Mean time per output token after the first, one sample per request.",
    buckets=_TOKEN_BUCKETS,
)
ITL_SECONDS = Histogram(
    "pdserve_itl_seconds",
    "Time between consecutive tokens seen by the client, one sample per token.",
    buckets=_TOKEN_BUCKETS,
)
E2E_SECONDS = Histogram(
    "pdserve_e2e_seconds", "Time from request arrival to its last token.", buckets=_E2E_BUCKETS
)

# --- requests and routing (router) ---------------------------------------------------------
REQUESTS = Counter(
    "pdserve_requests_total",
    "Finished requests by outcome: stop, length, cancelled, rejected, error.",
    ["outcome"],
)
ROUTING_DECISIONS = Counter(
    "pdserve_routing_decisions_total",
    "Routing decisions: remote (prefill worker + KV transfer), local (decode worker "
    "prefills), rejected (admission control).",
    ["decision"],
)
PREFIX_HIT_TOKENS = Counter(
    "pdserve_prefix_hit_tokens_total", "Prompt tokens found in the chosen worker's prefix cache."
)
PREFIX_QUERY_TOKENS = Counter(
    "pdserve_prefix_query_tokens_total",
    "Prompt tokens looked up in the prefix index; hit rate = hit / query.",
)

# --- KV transfer ---------------------------------------------------------------------------
KV_TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes_total", "KV cache bytes sent from prefill to decode workers."
)
KV_TRANSFER_FAILURES = Counter(
    "pdserve_kv_transfer_failures_total",
    "Failed KV transfers by reason: timeout, checksum, rejected, connection, worker_died.",
    ["reason"],
)
KV_TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_seconds",
    "Duration of one request's KV transfer, first chunk to commit.",
    buckets=_TRANSFER_BUCKETS,
)

# --- workers and dependencies --------------------------------------------------------------
QUEUE_LENGTH = Gauge(
    "pdserve_queue_length", "Requests waiting in a worker's scheduler queue.", ["worker"]
)
KV_BLOCKS = Gauge(
    "pdserve_kv_blocks", "KV cache blocks of a worker by state: used, free.", ["worker", "state"]
)
REDIS_UP = Gauge("pdserve_redis_up", "1 if the prefix index's Redis answered its last call.")


def start_metrics_server(port: int = 0, addr: str = "0.0.0.0") -> int:
    """Serves `/metrics` of the default registry from a daemon thread; returns the bound
    port (pass 0 for an ephemeral one)."""
    server, _thread = start_http_server(port, addr=addr)
    return server.server_port
