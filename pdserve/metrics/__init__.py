"""The Prometheus metrics of pdserve, defined once so every process names them the same.

Each process has its own default registry and serves it with `start_metrics_server`: the
router (`--metrics-port`) exports the request-level metrics, routing decisions, the transfers it
saw succeed or fail, and every worker's gauges (from the stats it polls); a worker
(`--worker-metrics-port`) exports its own gauges and its side of each transfer. Both ends
count a transfer, so never sum transfer counters across the router and worker jobs.
Label values used across the code base are listed in each metric's help text; keep them to those
few values (label cardinality is memory). Importing this package registers every series; callers
use the names below as `metrics.X`.

Modules:
- `buckets.py` — the histogram buckets in seconds the series share.
- `router_series.py` — request latency, outcomes, routing and the requests the router holds.
- `transfer_series.py` — KV transfer bytes, failures by reason, durations.
- `index_series.py` — Redis and the router's copy of the prefix index.
- `worker_series.py` — a worker's gauges and prefix-cache hits, set from its `WorkerStats`.
- `speculation_series.py` — speculative decoding per worker; the counts between two snapshots.
- `expert_series.py` — mixture-of-experts load per worker.
- `model_series.py` — the served model under vLLM's names (`vllm:*`).
- `planner_series.py` — the online planner's choice and the role switches it made.
- `endpoint.py` — `/metrics` served over HTTP or TLS.
"""

from pdserve.metrics.endpoint import start_metrics_server, stop_metrics_server
from pdserve.metrics.expert_series import expert_load
from pdserve.metrics.index_series import (
    INDEX_MIRROR_EVENTS,
    INDEX_MIRROR_READS,
    INDEX_MIRROR_UP,
    REDIS_UP,
)
from pdserve.metrics.model_series import (
    MODEL_ITL_SECONDS,
    MODEL_SPEC_COUNTERS,
    observe_model_load,
    observe_model_speculation,
    observe_request,
)
from pdserve.metrics.planner_series import observe_plan, observe_role_switch
from pdserve.metrics.router_series import (
    E2E_SECONDS,
    ITL_SECONDS,
    PREFIX_HIT_TOKENS,
    PREFIX_QUERY_TOKENS,
    REQUESTS,
    ROUTER_LOOP_STALL_SECONDS,
    ROUTING_DECISIONS,
    TPOT_SECONDS,
    TTFT_SECONDS,
    track_router_pending,
)
from pdserve.metrics.speculation_series import speculation_delta
from pdserve.metrics.transfer_series import (
    KV_TRANSFER_BYTES,
    KV_TRANSFER_FAILURES,
    KV_TRANSFER_SECONDS,
    transfer_failure_reason,
)
from pdserve.metrics.worker_series import KV_BLOCKS, observe_worker_stats

__all__ = [
    "E2E_SECONDS",
    "INDEX_MIRROR_EVENTS",
    "INDEX_MIRROR_READS",
    "INDEX_MIRROR_UP",
    "ITL_SECONDS",
    "KV_BLOCKS",
    "KV_TRANSFER_BYTES",
    "KV_TRANSFER_FAILURES",
    "KV_TRANSFER_SECONDS",
    "MODEL_ITL_SECONDS",
    "MODEL_SPEC_COUNTERS",
    "PREFIX_HIT_TOKENS",
    "PREFIX_QUERY_TOKENS",
    "REDIS_UP",
    "REQUESTS",
    "ROUTER_LOOP_STALL_SECONDS",
    "ROUTING_DECISIONS",
    "TPOT_SECONDS",
    "TTFT_SECONDS",
    "expert_load",
    "observe_model_load",
    "observe_model_speculation",
    "observe_plan",
    "observe_request",
    "observe_role_switch",
    "observe_worker_stats",
    "speculation_delta",
    "start_metrics_server",
    "stop_metrics_server",
    "track_router_pending",
    "transfer_failure_reason",
]
