"""The served model's metrics under vLLM's names (pdserve/metrics/)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from pdserve import metrics
from pdserve.core.messages import WorkerStats


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_load_gauges_sum_the_workers() -> None:
    stats = [
        WorkerStats(
            "p0", "prefill", 1, num_waiting=3, num_running=1, num_blocks=100, num_used_blocks=10
        ),
        WorkerStats(
            "d0", "decode", 1, num_waiting=1, num_running=4, num_blocks=100, num_used_blocks=50
        ),
        WorkerStats(
            "d1", "decode", 1, num_waiting=0, num_running=2, num_blocks=200, num_used_blocks=40
        ),
    ]
    metrics.observe_model_load("load-test", stats)
    assert sample("vllm:num_requests_running", model_name="load-test") == 6  # decode workers
    assert sample("vllm:num_requests_waiting", model_name="load-test") == 4
    assert sample("vllm:kv_cache_usage_perc", model_name="load-test") == 0.25
    metrics.observe_model_load("load-test", [])
    assert sample("vllm:kv_cache_usage_perc", model_name="load-test") == 0.0


def test_only_requests_that_produced_tokens_are_counted() -> None:
    common = {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3, "queue_s": 0.01}
    metrics.observe_request("count-test", finished_reason=None, ttft_s=None, e2e_s=None, **common)
    assert sample("vllm:prompt_tokens_total", model_name="count-test") is None
    metrics.observe_request("count-test", finished_reason="stop", ttft_s=0.1, e2e_s=0.5, **common)
    metrics.observe_request("count-test", finished_reason=None, ttft_s=0.1, e2e_s=None, **common)
    assert sample("vllm:prompt_tokens_total", model_name="count-test") == 20
    assert sample("vllm:prefix_cache_hits_total", model_name="count-test") == 8
    assert sample("vllm:prefix_cache_queries_total", model_name="count-test") == 20
    assert sample("vllm:generation_tokens_total", model_name="count-test") == 6
    for reason in ("stop", "abort"):
        labels = {"model_name": "count-test", "finished_reason": reason}
        assert sample("vllm:request_success_total", **labels) == 1
    assert sample("vllm:e2e_request_latency_seconds_count", model_name="count-test") == 1
    assert sample("vllm:time_to_first_token_seconds_count", model_name="count-test") == 2
