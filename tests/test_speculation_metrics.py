"""Speculative decoding's Prometheus counters (pdserve/metrics/): pdserve_spec_* per worker
and vLLM's spec_decode names per model, from the WorkerStats the router polls."""

from __future__ import annotations

from prometheus_client import REGISTRY

from pdserve import metrics
from pdserve.core.messages import WorkerStats


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def polled(epoch: int, draft: int, accepted: int, steps: int, worker: str) -> WorkerStats:
    return WorkerStats(
        worker,
        "decode",
        epoch,
        spec_draft_tokens=draft,
        spec_accepted_tokens=accepted,
        spec_verify_steps=steps,
    )


def test_counters_grow_by_what_happened_between_polls_and_survive_a_restart() -> None:
    worker, model = "spec-test-0", "spec-test-model"
    polls = [polled(1, 0, 0, 0, worker), polled(1, 40, 30, 10, worker)]
    polls += [polled(1, 60, 36, 15, worker), polled(2, 8, 8, 2, worker)]  # restarted: epoch 2
    previous = None
    for stats in polls:
        metrics.observe_worker_stats(stats, previous)
        metrics.observe_model_speculation(model, previous, stats)
        previous = stats
    assert sample("pdserve_spec_draft_tokens_total", worker=worker) == 68
    assert sample("pdserve_spec_accepted_tokens_total", worker=worker) == 44
    assert sample("pdserve_spec_verify_steps_total", worker=worker) == 17
    assert sample("vllm:spec_decode_num_draft_tokens_total", model_name=model) == 68
    assert sample("vllm:spec_decode_num_accepted_tokens_total", model_name=model) == 44
    assert sample("vllm:spec_decode_num_drafts_total", model_name=model) == 17
    # The gauges describe the worker since it (re)started.
    assert sample("pdserve_spec_acceptance_ratio", worker=worker) == 1.0
    assert sample("pdserve_spec_mean_accepted_tokens", worker=worker) == 4.0


def test_workers_that_never_speculated_have_no_series() -> None:
    metrics.observe_worker_stats(polled(1, 0, 0, 0, "plain-0"), None)
    assert sample("pdserve_spec_draft_tokens_total", worker="plain-0") is None
