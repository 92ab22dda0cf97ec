"""The Prometheus metrics of pdserve, defined once so every process names them the same.

Each process has its own default registry and serves it with `start_metrics_server`: the
router (`--metrics-port`) exports the request-level metrics, routing decisions, the transfers it
saw succeed or fail, and every worker's gauges (from the stats it polls); a worker
(`--worker-metrics-port`) exports its own gauges and its side of each transfer. Both ends
count a transfer, so never sum transfer counters across the router and worker jobs.
Label values used across the code base are listed in each metric's help text; keep them to those
few values (label cardinality is memory).
"""

from __future__ import annotations

from typing import Any

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
    "Time between consecutive token-carrying responses seen by the client, one sample per "
    "response (vLLM's definition; a response may carry several tokens).",
    buckets=_TOKEN_BUCKETS,
)
E2E_SECONDS = Histogram(
    "pdserve_e2e_seconds", "Time from request arrival to its last token.", buckets=_E2E_BUCKETS
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
    "Failed KV transfers by reason: timeout, checksum, rejected, connection, worker_died, other.",
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
PREFIX_HIT_RATIO = Gauge(
    "pdserve_prefix_hit_ratio",
    "Share of a worker's prompt tokens found in its prefix cache since it started.",
    ["worker"],
)
REDIS_UP = Gauge(
    "pdserve_redis_up",
    "1 if the prefix index's Redis answered its last call (the router pings it every second).",
)


def observe_worker_stats(stats: Any) -> None:
    """Sets the gauges of one worker from its `WorkerStats` (cheap: a few dict lookups)."""
    worker = stats.worker_id
    QUEUE_LENGTH.labels(worker=worker).set(stats.num_waiting)
    KV_BLOCKS.labels(worker=worker, state="used").set(stats.num_used_blocks)
    KV_BLOCKS.labels(worker=worker, state="free").set(stats.num_free_blocks)
    if stats.prefix_query_tokens:
        ratio = stats.prefix_hit_tokens / stats.prefix_query_tokens
        PREFIX_HIT_RATIO.labels(worker=worker).set(ratio)


# gRPC status names (as KV-transfer errors spell them) -> KV_TRANSFER_FAILURES reason.
_FAILURE_REASONS = {
    "DEADLINE_EXCEEDED": "timeout",
    "DATA_LOSS": "checksum",
    "UNAVAILABLE": "connection",
    "NOT_FOUND": "rejected",
    "FAILED_PRECONDITION": "rejected",
    "INVALID_ARGUMENT": "rejected",
    "UNAUTHENTICATED": "rejected",
    "PERMISSION_DENIED": "rejected",
    "ActorDiedError": "worker_died",
    "RayActorError": "worker_died",
    "ActorUnavailableError": "worker_died",
}


def transfer_failure_reason(error: BaseException | str) -> str:
    """The KV_TRANSFER_FAILURES label of a failed transfer, from its error (or its text):
    transports raise KVTransferError with the gRPC status name in the message."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return next((reason for key, reason in _FAILURE_REASONS.items() if key in text), "other")


_servers: dict[int, Any] = {}  # bound port -> its HTTP server, for stop_metrics_server


def start_metrics_server(port: int = 0, addr: str = "0.0.0.0") -> int:
    """Serves `/metrics` of the default registry from a daemon thread; returns the bound
    port (pass 0 for an ephemeral one)."""
    server, _thread = start_http_server(port, addr=addr)
    _servers[server.server_port] = server
    return server.server_port


def stop_metrics_server(port: int) -> None:
    """Stops the server `start_metrics_server` bound to `port` (an app stopping in a process
    that lives on, as in tests). Unknown ports are ignored."""
    server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()
