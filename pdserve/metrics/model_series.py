"""The served model under vLLM's names (router; label `model_name`), set by `observe_request`,
`observe_model_load` and `observe_model_speculation`."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from pdserve.metrics.buckets import E2E_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS
from pdserve.metrics.speculation_series import speculation_delta

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
    buckets=TTFT_BUCKETS,
)
MODEL_TTFT_SECONDS = Histogram(
    "vllm:time_to_first_token_seconds",
    "Time from request arrival to its first token.",
    ["model_name"],
    buckets=TTFT_BUCKETS,
)
MODEL_E2E_SECONDS = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Time from request arrival to its last token.",
    ["model_name"],
    buckets=E2E_BUCKETS,
)
MODEL_TPOT_SECONDS = Histogram(
    "vllm:time_per_output_token_seconds",
    "Mean time per output token after the first, one sample per finished request.",
    ["model_name"],
    buckets=TOKEN_BUCKETS,
)
MODEL_ITL_SECONDS = Histogram(
    "vllm:inter_token_latency_seconds",
    "Time between a request's consecutive token-carrying responses, one sample per response "
    "after the first (a response may carry several tokens; see --stream-one-token-per-event).",
    ["model_name"],
    buckets=TOKEN_BUCKETS,
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
    MODEL_RUNNING.labels(model).set(sum(s.num_running for s in stats if s.role != "prefill"))
    MODEL_WAITING.labels(model).set(sum(s.num_waiting for s in stats))
    blocks = sum(s.num_blocks for s in stats)
    used = sum(s.num_used_blocks for s in stats)
    MODEL_KV_USAGE.labels(model).set(used / blocks if blocks else 0.0)


def observe_model_speculation(model: str, previous: Any | None, stats: Any) -> None:
    """Adds one worker's speculative decoding since `previous` to the served model's counters."""
    for counter, amount in zip(
        MODEL_SPEC_COUNTERS, speculation_delta(previous, stats), strict=True
    ):
        if amount:
            counter.labels(model).inc(amount)
