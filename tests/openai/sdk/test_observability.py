"""What the served system (tests/openai/sdk/conftest.py) shows of an HTTP request: probes and
metrics on the HTTP port, the client's traceparent on both workers, vLLM-named metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import REGISTRY

from tests.openai.served import LOW, greedy


def test_probes_and_metrics_on_the_http_port(served):
    base = f"http://127.0.0.1:{served.http_port}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready").status_code == 200
    metrics = httpx.get(f"{base}/metrics").text
    assert 'pdserve_requests_total{outcome="length"}' in metrics


def test_the_clients_traceparent_reaches_both_workers(served, client, model):
    import ray

    trace_id = "5cf92f3577b34da6a3ce929d0e0e4736"
    response = client.completions.create(
        model=model,
        prompt=list(range(LOW + 30, LOW + 42)),
        max_tokens=3,
        extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        **greedy(),
    )
    work_id = response.id.removeprefix("cmpl-")
    (decode,) = served.app.pool.of_role("decode")
    seen = ray.get(decode.actor.trace_contexts.remote())[work_id]
    # Through the router's Ray call and through the prefill worker's KV chunks and commit.
    assert seen["ray"]["traceparent"].split("-")[1] == trace_id
    assert seen["kv"]["traceparent"].split("-")[1] == trace_id


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_vllm_named_metrics_count_the_request_under_the_model(served, client, model):
    before = {
        "prompt": sample("vllm:prompt_tokens_total", model_name=model),
        "generation": sample("vllm:generation_tokens_total", model_name=model),
        "length": sample("vllm:request_success_total", model_name=model, finished_reason="length"),
        "ttft": sample("vllm:time_to_first_token_seconds_count", model_name=model),
    }
    response = client.completions.create(
        model=model, prompt=list(range(LOW + 330, LOW + 347)), max_tokens=7, **greedy()
    )
    assert response.usage.prompt_tokens == 17
    assert sample("vllm:prompt_tokens_total", model_name=model) == before["prompt"] + 17
    assert sample("vllm:generation_tokens_total", model_name=model) == before["generation"] + 7
    assert (
        sample("vllm:request_success_total", model_name=model, finished_reason="length")
        == before["length"] + 1
    )
    assert sample("vllm:time_to_first_token_seconds_count", model_name=model) == before["ttft"] + 1
    scraped = httpx.get(f"http://127.0.0.1:{served.http_port}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert f'{name}{{model_name="{model}"}}' in scraped


def test_vllm_tpot_and_itl_histograms_count_the_request_under_the_model(client, model):
    names = (
        "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    )

    def histograms() -> dict[str, tuple[float, float]]:
        return {
            n: (sample(f"{n}_count", model_name=model), sample(f"{n}_sum", model_name=model))
            for n in names
        }

    before = histograms()
    list(
        client.completions.create(
            model=model,
            prompt=list(range(LOW + 360, LOW + 377)),
            max_tokens=7,
            stream=True,
            stream_options={"one_token_per_event": True},
            **greedy(),
        )
    )
    after = histograms()
    count = {n: after[n][0] - before[n][0] for n in names}
    total = {n: after[n][1] - before[n][1] for n in names}
    tpot, itl, ttft, e2e = names
    assert count[tpot] == 1 and count[itl] == 6  # one per request; one per token after the first
    assert total[tpot] == pytest.approx((total[e2e] - total[ttft]) / 6, rel=1e-6)
    assert total[itl] == pytest.approx(total[e2e] - total[ttft], rel=1e-6)
