"""The online cost model: priors before data, the measured line after, counters from stats."""

from __future__ import annotations

import pytest

from pdserve.core.messages import WorkerStats
from router.cost_model import CostModel, LinearFit


def test_prior_answers_before_any_data() -> None:
    fit = LinearFit(prior_intercept=0.01, prior_slope=1e-4, x_scale=512)
    assert fit.predict(1000) == pytest.approx(0.01 + 0.1)


def test_fit_converges_to_the_measured_line() -> None:
    fit = LinearFit(prior_intercept=0.01, prior_slope=1e-4, x_scale=512)
    for i in range(200):
        tokens = 64 + (i * 37) % 2000
        fit.observe(tokens, 0.05 + 2e-3 * tokens)  # 20x slower per token than the prior
    a, b = fit.coefficients
    assert a == pytest.approx(0.05, rel=0.05) and b == pytest.approx(2e-3, rel=0.02)


def test_fit_follows_a_change_in_speed() -> None:
    fit = LinearFit(prior_intercept=0.0, prior_slope=1e-3, x_scale=16)
    for i in range(100):
        fit.observe(1 + i % 32, 0.01 * (1 + i % 32))
    for i in range(200):  # the worker got twice as fast
        fit.observe(1 + i % 32, 0.005 * (1 + i % 32))
    assert fit.predict(16) == pytest.approx(0.08, rel=0.05)


def test_coefficients_never_go_negative() -> None:
    fit = LinearFit(prior_intercept=0.01, prior_slope=1e-4, x_scale=512)
    for tokens in (10, 20, 4000, 8000):
        fit.observe(tokens, 1.0 if tokens < 100 else 0.01)  # nonsense: time falls with work
    a, b = fit.coefficients
    assert a >= 0 and b >= 0


def stats(worker: str, role: str, epoch: int = 1, **counters) -> WorkerStats:
    return WorkerStats(worker_id=worker, role=role, epoch=epoch, **counters)


def test_learns_from_worker_counters_between_polls() -> None:
    cost = CostModel()
    cost.observe_stats(stats("d0", "decode", decode_steps=10, decode_seconds=1.0, decode_tokens=80))
    for poll in range(1, 60):
        cost.observe_stats(
            stats(
                "d0",
                "decode",
                decode_steps=10 + 100 * poll,
                decode_seconds=1.0 + 100 * poll * (0.02 + 0.001 * 8),  # batch 8: 28 ms a step
                decode_tokens=80 + 800 * poll,
            )
        )
    assert cost.decode_step_seconds(8) == pytest.approx(0.028, rel=0.05)
    # A prefill worker's counters teach prefill and transfer costs.
    cost.observe_stats(stats("p0", "prefill"))
    for poll in range(1, 40):
        cost.observe_stats(
            stats(
                "p0",
                "prefill",
                prefill_tokens=1000 * poll,
                prefill_seconds=1.0 * poll,
                transfer_bytes=(100 << 20) * poll,
                transfer_seconds=0.1 * poll,
            )
        )
    assert cost.prefill_seconds(1000) == pytest.approx(1.0, rel=0.1)
    assert cost.transfer_seconds(100 << 20) == pytest.approx(0.1, rel=0.1)
    assert not cost.local_prefill.samples  # decode-side prefill still uses the pool's line
    assert cost.prefill_seconds(1000, local=True) == cost.prefill_seconds(1000)


def test_a_workers_step_is_measured_over_its_recent_polls_prompt_steps_included() -> None:
    # d0 decodes at 17 ms a step, then takes local prompts: 1 step in 10 runs a 200 ms chunk.
    # Its running requests get a token a step, so the mean over every step is their TPOT now.
    cost = CostModel()
    assert cost.step_seconds("d0") is None  # nothing measured yet
    steps, seconds, prompt_steps, prompt_seconds = 0, 0.0, 0, 0.0
    cost.observe_stats(stats("d0", "decode"))
    for _ in range(30):
        steps, seconds = steps + 100, seconds + 100 * 0.017
        cost.observe_stats(stats("d0", "decode", decode_steps=steps, decode_seconds=seconds))
    assert cost.step_seconds("d0") == pytest.approx(0.017)
    for _ in range(30):  # the recent polls, not the last minute: within a few polls
        steps, seconds = steps + 90, seconds + 90 * 0.017
        prompt_steps, prompt_seconds = prompt_steps + 10, prompt_seconds + 10 * 0.2
        counters = {"decode_steps": steps, "decode_seconds": seconds,
                    "prefill_steps": prompt_steps, "prefill_seconds": prompt_seconds}  # fmt: skip
        cost.observe_stats(stats("d0", "decode", **counters))
    assert cost.step_seconds("d0") == pytest.approx(0.9 * 0.017 + 0.1 * 0.2, rel=0.01)
    # An idle poll says nothing of the next step; another worker keeps its own.
    cost.observe_stats(stats("d0", "decode", **counters))
    assert cost.step_seconds("d0") == pytest.approx(0.9 * 0.017 + 0.1 * 0.2, rel=0.01)
    assert cost.step_seconds("d1") is None


def test_a_decode_workers_peer_pull_pushes_teach_the_transfer_line() -> None:
    # A colocated cluster has no prefill worker: its pulls' pushes are the only transfers.
    cost = CostModel()
    cost.observe_stats(stats("d0", "decode"))
    for poll in range(1, 40):
        sent = {"transfer_bytes": (100 << 20) * poll, "transfer_seconds": 0.01 * poll}
        cost.observe_stats(stats("d0", "decode", **sent))
    assert cost.transfer_seconds(100 << 20) == pytest.approx(0.01, rel=0.1)


def test_a_restarted_worker_is_not_differenced_against_its_past() -> None:
    cost = CostModel()
    cost.observe_stats(stats("p0", "prefill", prefill_tokens=10_000, prefill_seconds=100.0))
    cost.observe_stats(stats("p0", "prefill", epoch=2, prefill_tokens=10, prefill_seconds=0.01))
    assert cost.prefill.samples == 0


def test_per_request_prefill_timings_replace_interval_samples() -> None:
    cost = CostModel()
    for _ in range(40):  # 32-token and 288-token prefills at 1 ms per token plus 10 ms
        cost.observe_request_prefill(32, 0.042)
        cost.observe_request_prefill(288, 0.298)
    assert cost.prefill_seconds(288) - cost.prefill_seconds(32) == pytest.approx(0.256, rel=0.1)
    before = cost.prefill.coefficients
    # An interval lumping prefills and their overheads together would bend the line; ignored.
    cost.observe_stats(stats("p0", "prefill"))
    cost.observe_stats(stats("p0", "prefill", prefill_tokens=64, prefill_seconds=0.5))
    assert cost.prefill.coefficients == before


def test_samples_of_one_size_above_the_prior_keep_a_slope() -> None:
    # A warm-up of equal prompts on a slow machine: every sample at 128 tokens, far above the
    # prior line. The slope cannot be measured; it must not collapse to 0 (a cached prefix
    # would then save nothing): the prior's shape is kept at the measured level.
    fit = LinearFit(prior_intercept=0.01, prior_slope=1e-4, x_scale=512)
    for _ in range(8):
        fit.observe(128, 0.15)
    a, b = fit.coefficients
    assert b > 0 and a / b == pytest.approx(100)  # the prior's intercept/slope ratio
    assert fit.predict(128) == pytest.approx(0.15, rel=0.2)


def test_a_local_prefill_is_never_estimated_cheaper_than_on_a_prefill_worker() -> None:
    # The local line comes from engine step time, the pool's from whole requests with their
    # overheads: trusted alone, the local one made the same work look half as expensive.
    cost = CostModel()
    for tokens in (128, 512):
        for _ in range(20):
            cost.observe_request_prefill(tokens, 0.1 + 1e-3 * tokens)
            cost.observe_prefill(tokens, 0.02 + 5e-4 * tokens, local=True)
    assert cost.prefill_seconds(288, local=True) == cost.prefill_seconds(288)
    assert cost.prefill_queue_seconds(600, 2, local=True) == cost.prefill_queue_seconds(600, 2)
    for _ in range(50):  # a decode worker that really is slower at prefill still counts so
        cost.observe_prefill(288, 2.0, local=True)
    assert cost.prefill_seconds(288, local=True) > 1.5 > cost.prefill_seconds(288)


def test_a_colocated_cluster_prices_local_prefills_by_its_measurements_not_a_prior() -> None:
    # No prefill worker: the pool's line never gets a sample. Its prior (0.42 s for 4096
    # tokens) outweighed the measured local line (an 8B on an H100: 0.11 s) in every estimate,
    # a 4x overestimate of each cold prefix and of each queue behind one (issue 50).
    cost = CostModel(step_tokens=8192)
    for tokens in (64, 4160):
        for _ in range(20):
            cost.observe_prefill(tokens, 0.006 + 2.5e-5 * tokens, local=True)
    assert not cost.prefill.samples
    assert cost.prefill_seconds(4096, local=True) == pytest.approx(0.108, rel=0.05)
    assert cost.prefill_queue_seconds(4096, 1, local=True) == pytest.approx(0.102, rel=0.05)
    assert cost.stall_seconds(4096) == cost.prefill_seconds(4096, local=True)


def test_a_queue_pays_the_fixed_cost_per_engine_step_not_per_request() -> None:
    cost = CostModel(step_tokens=512)
    for tokens in (32, 288, 512):
        for _ in range(20):
            cost.observe_request_prefill(tokens, 0.15 + 3e-4 * tokens)
    a, b = cost.prefill.coefficients
    # Three short prompts share one step with the newcomer: their tokens, no intercept.
    assert cost.prefill_queue_seconds(96, 3) == pytest.approx(b * 96)
    # 1200 tokens take two full steps before the newcomer's: two intercepts.
    assert cost.prefill_queue_seconds(1200, 1) == pytest.approx(a + b * 1200)
    assert cost.prefill_queue_seconds(1200, 3) == pytest.approx(2 * a + b * 1200)


def test_a_prefill_workers_queue_drains_at_its_measured_prompt_rate() -> None:
    # The per-request line's intercept is a lone request's overheads; paid per full step, it put
    # 70B TP 4 queues at twice their wait (docs/benchmarks/simulation.md). Polls of the prefill
    # workers measure how fast their prompt steps compute: 20,000 tokens in 1.5 s here.
    cost = CostModel(step_tokens=512)
    for tokens in (128, 256, 384):
        cost.observe_request_prefill(tokens, 0.028 + 6.7e-5 * tokens)
    assert cost.drain_seconds_per_token() is None
    line_wait = cost.prefill_queue_seconds(8192, 32)
    cost.observe_stats(stats("p0", "prefill"))
    cost.observe_stats(stats("p0", "prefill", prefill_tokens=20_000, prefill_seconds=1.5))
    assert cost.prefill_queue_seconds(8192, 32) == pytest.approx(8192 * 1.5 / 20_000)
    assert cost.prefill_queue_seconds(8192, 32) < 0.6 * line_wait
    # A local queue shares its worker's steps with decoding: still priced by its lines.
    assert cost.prefill_queue_seconds(8192, 32, local=True) == pytest.approx(line_wait)
