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

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from pdserve.core.kv_events import KV_TIERS
from pdserve.tls_files import CertificateFiles

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
    "pdserve_kv_blocks",
    "KV cache blocks of a worker by state: used, free (device pool), host (prefix-cache blocks "
    "kept in host memory, --kv-offload-gb), disk (kept in files, --kv-disk-dir).",
    ["worker", "state"],
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "pdserve_prefix_cache_hit_tokens",
    "Prompt tokens a worker found in its prefix cache, by tier: device (its KV pool), host "
    "(brought back from host memory instead of recomputed) or disk (read back from a file).",
    ["worker", "tier"],
)
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
REDIS_UP = Gauge(
    "pdserve_redis_up",
    "1 if the prefix index's Redis answered its last call (the router pings it every second).",
)
INDEX_MIRROR_UP = Gauge(
    "pdserve_index_mirror_up",
    "1 while the router's copy of the prefix index is built and follows the event stream.",
)
INDEX_MIRROR_EVENTS = Counter(
    "pdserve_index_mirror_events",
    "Entries of the prefix index's event stream applied to the router's copy.",
)
INDEX_MIRROR_READS = Counter(
    "pdserve_index_mirror_reads",
    "State the router's copy of the prefix index read from Redis: whole (build: at start, after "
    "an outage) or one worker's blocks (worker: a reset, a restart, a gap in its events).",
    ["scope"],
)

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

# --- the served model, under vLLM's names (router) -----------------------------------------
# Dashboards, autoscalers (KEDA, HPA on custom metrics) and gateways written for vLLM read these
# unchanged: same names, types, units and labels (`model_name`, `finished_reason`).
# docs/metrics.md maps every pdserve_* metric to its vLLM counterpart.
MODEL_PROMPT_TOKENS = Counter(
    "vllm:prompt_tokens", "Prompt tokens of requests that were computed.", ["model_name"]
)
MODEL_GENERATION_TOKENS = Counter(
    "vllm:generation_tokens", "Tokens generated for clients.", ["model_name"]
)
MODEL_CACHED_TOKENS = Counter(
    "vllm:prefix_cache_hits",
    "Prompt tokens found in a worker's prefix cache (cached_tokens of the responses).",
    ["model_name"],
)
MODEL_CACHE_QUERIES = Counter(
    "vllm:prefix_cache_queries",
    "Prompt tokens looked up in the prefix caches; hit rate = hits / queries.",
    ["model_name"],
)
MODEL_REQUESTS_FINISHED = Counter(
    "vllm:request_success",
    "Requests that produced tokens, by finish reason: stop, length, abort (client left or "
    "failed after its first token).",
    ["model_name", "finished_reason"],
)
MODEL_QUEUE_SECONDS = Histogram(
    "vllm:request_queue_time_seconds",
    "Time a request's prompt waited in a worker's queue before computing.",
    ["model_name"],
    buckets=_TTFT_BUCKETS,
)
MODEL_TTFT_SECONDS = Histogram(
    "vllm:time_to_first_token_seconds",
    "Time from request arrival to its first token.",
    ["model_name"],
    buckets=_TTFT_BUCKETS,
)
MODEL_E2E_SECONDS = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Time from request arrival to its last token.",
    ["model_name"],
    buckets=_E2E_BUCKETS,
)
MODEL_TPOT_SECONDS = Histogram(
    "vllm:time_per_output_token_seconds",
    "Mean time per output token after the first, one sample per finished request.",
    ["model_name"],
    buckets=_TOKEN_BUCKETS,
)
MODEL_ITL_SECONDS = Histogram(
    "vllm:inter_token_latency_seconds",
    "Time between a request's consecutive token-carrying responses, one sample per response "
    "after the first (a response may carry several tokens; see --stream-one-token-per-event).",
    ["model_name"],
    buckets=_TOKEN_BUCKETS,
)
MODEL_RUNNING = Gauge(
    "vllm:num_requests_running", "Requests decoding on the workers.", ["model_name"]
)
MODEL_WAITING = Gauge(
    "vllm:num_requests_waiting",
    "Requests waiting in the workers' queues for their prompt to be computed.",
    ["model_name"],
)
MODEL_KV_USAGE = Gauge(
    "vllm:kv_cache_usage_perc",
    "Share of all workers' KV cache blocks in use by requests (0 to 1).",
    ["model_name"],
)
MODEL_SPEC_DRAFTS = Counter(
    "vllm:spec_decode_num_drafts",
    "Speculation rounds: one per sequence per step that verified draft tokens.",
    ["model_name"],
)
MODEL_SPEC_DRAFT_TOKENS = Counter(
    "vllm:spec_decode_num_draft_tokens", "Draft tokens verified by the target.", ["model_name"]
)
MODEL_SPEC_ACCEPTED_TOKENS = Counter(
    "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", ["model_name"]
)
MODEL_SPEC_COUNTERS = (MODEL_SPEC_DRAFT_TOKENS, MODEL_SPEC_ACCEPTED_TOKENS, MODEL_SPEC_DRAFTS)
# The WorkerStats counts behind each speculative decoding counter, in the same order.
SPEC_COUNT_FIELDS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")


def observe_request(
    model: str,
    *,
    finished_reason: str | None,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    queue_s: float,
    ttft_s: float | None,
    e2e_s: float | None,
) -> None:
    """Counts one request that ended under the served model's metrics. `ttft_s` None = it
    produced no token (refused or failed before): only requests that did are counted. TPOT,
    as vLLM's: (E2E - TTFT) / (completion tokens - 1), of requests that finished."""
    if ttft_s is None:
        return
    MODEL_PROMPT_TOKENS.labels(model).inc(prompt_tokens)
    MODEL_CACHED_TOKENS.labels(model).inc(cached_tokens)
    MODEL_CACHE_QUERIES.labels(model).inc(prompt_tokens)
    MODEL_GENERATION_TOKENS.labels(model).inc(completion_tokens)
    MODEL_REQUESTS_FINISHED.labels(model, finished_reason or "abort").inc()
    MODEL_QUEUE_SECONDS.labels(model).observe(queue_s)
    MODEL_TTFT_SECONDS.labels(model).observe(ttft_s)
    if e2e_s is not None and finished_reason in ("stop", "length"):
        MODEL_E2E_SECONDS.labels(model).observe(e2e_s)
        if completion_tokens > 1:
            MODEL_TPOT_SECONDS.labels(model).observe((e2e_s - ttft_s) / (completion_tokens - 1))


def observe_model_load(model: str, stats: list[Any]) -> None:
    """Sets the served model's load gauges from every worker's latest `WorkerStats`."""
    MODEL_RUNNING.labels(model).set(sum(s.num_running for s in stats if s.role == "decode"))
    MODEL_WAITING.labels(model).set(sum(s.num_waiting for s in stats))
    blocks = sum(s.num_blocks for s in stats)
    used = sum(s.num_used_blocks for s in stats)
    MODEL_KV_USAGE.labels(model).set(used / blocks if blocks else 0.0)


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
    for tier, amount in zip(KV_TIERS, prefix_hit_delta(previous, stats), strict=True):
        if amount:
            PREFIX_CACHE_HIT_TOKENS.labels(worker=worker, tier=tier).inc(amount)
    WORKER_PEAK_MEMORY.labels(worker=worker, kind="rss").set(stats.peak_rss_bytes)
    WORKER_PEAK_MEMORY.labels(worker=worker, kind="gpu").set(stats.peak_gpu_bytes)
    if stats.prefix_query_tokens:
        ratio = stats.prefix_hit_tokens / stats.prefix_query_tokens
        PREFIX_HIT_RATIO.labels(worker=worker).set(ratio)
    if stats.spec_verify_steps:
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
    if stats.expert_tokens:
        _observe_expert_load(stats, previous)


def _observe_expert_load(stats: Any, previous: Any | None) -> None:
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


def observe_model_speculation(model: str, previous: Any | None, stats: Any) -> None:
    """Adds one worker's speculative decoding since `previous` to the served model's counters."""
    for counter, amount in zip(
        MODEL_SPEC_COUNTERS, speculation_delta(previous, stats), strict=True
    ):
        if amount:
            counter.labels(model).inc(amount)


def speculation_delta(previous: Any | None, stats: Any) -> tuple[int, ...]:
    """A worker's draft tokens, accepted tokens and verify steps between two snapshots of its
    `WorkerStats` (SPEC_COUNT_FIELDS); all of them when there is no earlier snapshot of the same
    epoch (the worker started, or restarted, since)."""
    fresh = previous is None or previous.epoch != stats.epoch
    return tuple(
        max(0, getattr(stats, name) - (0 if fresh else getattr(previous, name)))
        for name in SPEC_COUNT_FIELDS
    )


def prefix_hit_delta(previous: Any | None, stats: Any) -> tuple[int, int, int]:
    """A worker's prefix-cache hit tokens in the device, the host and the disk tier between
    two snapshots of its `WorkerStats` (all of them after a start or restart)."""
    fresh = previous is None or previous.epoch != stats.epoch

    def delta(name: str) -> int:
        return getattr(stats, name) - (0 if fresh else getattr(previous, name))

    host, disk = delta("prefix_host_hit_tokens"), delta("prefix_disk_hit_tokens")
    return max(0, delta("prefix_hit_tokens") - host - disk), max(0, host), max(0, disk)


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


# --- online planner (router, --plan-interval; router/online_plan.py) --------------------------
PLANNER_WORKERS = Gauge(
    "pdserve_planner_workers",
    "Workers of each role in the split the online planner chose for the last window "
    "(role: prefill, decode; prefill 0 = colocated).",
    ["role"],
)
PLANNER_GOODPUT_RPS = Gauge(
    "pdserve_planner_goodput_rps",
    "Predicted goodput (requests/s meeting both SLOs) of the chosen split on the last window.",
)
PLANNER_OBSERVED_RPS = Gauge(
    "pdserve_planner_observed_rps", "Requests/s the router served in the last window."
)
PLANNER_WORKERS_NEEDED = Gauge(
    "pdserve_planner_workers_needed",
    "Workers the observed rate needs if goodput scales with the worker count (an estimate).",
)


def observe_plan(plan: dict[str, Any]) -> None:
    """Exports one online plan (pdserve/planner/online.py's answer)."""
    PLANNER_WORKERS.labels("prefill").set(plan["prefill_workers"])
    PLANNER_WORKERS.labels("decode").set(plan["decode_workers"])
    PLANNER_GOODPUT_RPS.set(plan["goodput_rps"])
    PLANNER_OBSERVED_RPS.set(plan["observed_rps"])
    if plan.get("workers_for_observed") is not None:
        PLANNER_WORKERS_NEEDED.set(plan["workers_for_observed"])


def start_metrics_server(
    port: int = 0, addr: str = "0.0.0.0", tls: CertificateFiles | None = None
) -> int:
    """Serves `/metrics` of the default registry from a daemon thread; returns the bound
    port (pass 0 for an ephemeral one). With `tls`, over TLS, requiring a client certificate
    of its CA when it has one; files renewed in place are served from the next handshake."""
    if tls is None:
        server, _thread = start_http_server(port, addr=addr)
    else:
        server, _thread = start_http_server(
            port,
            addr=addr,
            certfile=str(tls.cert),
            keyfile=str(tls.key),
            client_cafile=str(tls.ca) if tls.ca else None,
            client_auth_required=tls.ca is not None,
        )
        tls.reload_at_handshakes(server.socket.context)
    _servers[server.server_port] = server
    return server.server_port


def stop_metrics_server(port: int) -> None:
    """Stops the server `start_metrics_server` bound to `port` (an app stopping in a process
    that lives on, as in tests). Unknown ports are ignored."""
    server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()


def track_router_pending(stages: Mapping[str, Callable[[], int]]) -> None:
    """`pdserve_router_pending` read from the router's live counts at each scrape."""
    for stage, count in stages.items():
        ROUTER_PENDING.labels(stage=stage).set_function(count)


# --- role switching (router, --role-switching; router/role_switch.py) -------------------------
ROLE_SWITCHES = Counter(
    "pdserve_role_switches",
    "Workers that changed role without a restart (worker; to_role: prefill, decode).",
    ["worker", "to_role"],
)
ROLE_SWITCH_SECONDS = Histogram(
    "pdserve_role_switch_seconds",
    "How long a role switch took, its drain included.",
    buckets=_TRANSFER_BUCKETS,
)
ROLE_SWITCH_BLOCKS_KEPT = Gauge(
    "pdserve_role_switch_blocks_kept",
    "Blocks of the worker's prefix cache kept through its last role switch.",
    ["worker"],
)


def observe_role_switch(switch: Any) -> None:
    """Exports one router.role_switch.RoleSwitch."""
    ROLE_SWITCHES.labels(worker=switch.worker_id, to_role=switch.to_role).inc()
    ROLE_SWITCH_SECONDS.observe(switch.seconds)
    ROLE_SWITCH_BLOCKS_KEPT.labels(worker=switch.worker_id).set(switch.blocks_kept)
