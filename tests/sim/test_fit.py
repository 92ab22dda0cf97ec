"""A linear profile fitted to measured steps recovers the costs that produced them, stays
non-negative, and is a --sim-profile file the sim engine accepts."""

from __future__ import annotations

import random

import pytest

from pdserve.sim.fit import fit_linear, profile_json
from pdserve.sim.profiles import parse_profile
from pdserve.sim.timing import Chunk, LinearTiming, StepWork

TRUE = LinearTiming(step_s=0.004, prefill_token_s=2e-4, decode_seq_s=5e-4, context_token_s=3e-6)


def mixed_steps(rng: random.Random, count: int) -> list[StepWork]:
    steps = []
    for _ in range(count):
        chunks = [Chunk(rng.randint(0, 500), 1, decode=True) for _ in range(rng.randint(0, 16))]
        if rng.random() < 0.5:
            chunks.append(Chunk(rng.randint(0, 200), rng.randint(2, 256), decode=False))
        steps.append(StepWork.of(chunks or [Chunk(0, 8, decode=False)], len(chunks) or 1))
    return steps


def test_the_fit_recovers_the_coefficients_through_noise(tmp_path):
    rng = random.Random(5)
    samples = [(w, TRUE.step_seconds(w) * rng.uniform(0.97, 1.03)) for w in mixed_steps(rng, 300)]
    fitted = fit_linear(samples)
    for name in ("step_s", "prefill_token_s", "decode_seq_s", "context_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    path = tmp_path / "cpu.json"
    path.write_text(profile_json(fitted, device="cpu"))
    assert parse_profile(str(path)) == fitted


def test_costs_that_do_not_exist_fit_to_zero_not_below():
    rng = random.Random(6)
    flat = LinearTiming(step_s=0.01, prefill_token_s=1e-4, decode_seq_s=0.0, context_token_s=0.0)
    # A slight downward trend in decode sequences would fit a negative coefficient.
    samples = [(w, flat.step_seconds(w) - 1e-6 * w.decode_seqs) for w in mixed_steps(rng, 100)]
    fitted = fit_linear(samples)
    assert fitted.decode_seq_s == 0.0
    assert min(fitted.step_s, fitted.prefill_token_s, fitted.context_token_s) >= 0.0


def test_too_few_or_uniform_samples_are_an_error():
    work = StepWork.of([Chunk(0, 1, decode=True)], 1)
    with pytest.raises(ValueError, match="cannot fit"):
        fit_linear([(work, 0.01)])
    with pytest.raises(ValueError, match="do not vary enough"):
        fit_linear([(work, 0.01)] * 10)


def test_a_step_holding_prompt_chunks_pays_its_fixed_cost_once():
    """An eager GPU step with prompt tokens costs a fixed extra (their attention runs as its own
    kernels in every layer): fitted as prefill_step_s, not spread over tokens or contexts."""
    rng = random.Random(7)
    true = LinearTiming(
        step_s=0.02,
        prefill_token_s=2e-5,
        decode_seq_s=2e-4,
        context_token_s=0,
        prefill_step_s=0.018,
    )
    samples = [(w, true.step_seconds(w) * rng.uniform(0.98, 1.02)) for w in mixed_steps(rng, 300)]
    fitted = fit_linear(samples)
    assert fitted.prefill_step_s == pytest.approx(0.018, rel=0.1)
    assert fitted.step_s == pytest.approx(0.02, rel=0.1)


def test_the_fixed_cost_of_prompt_steps_is_left_out_where_the_samples_cannot_tell_it_apart():
    # Every step with prompt tokens has no decode sequence and every other exactly one, so
    # "has prompt tokens" is 1 - decode sequences: the other coefficients already explain it.
    rng = random.Random(8)
    prompts = [StepWork.of([Chunk(0, rng.randint(8, 64), decode=False)], 1) for _ in range(20)]
    decodes = [StepWork.of([Chunk(rng.randint(8, 64), 1, decode=True)], 1) for _ in range(20)]
    samples = [(w, TRUE.step_seconds(w)) for w in prompts + decodes]
    fitted = fit_linear(samples)
    assert fitted.prefill_step_s == 0.0
    assert all(fitted.step_seconds(w) == pytest.approx(s, rel=1e-6) for w, s in samples)


def test_the_median_fit_is_the_typical_step_whatever_a_few_stalls_add():
    """One step in eight stalled on the host (3-6x): least squares charges the stalls to the
    coefficients, the median fit keeps the typical step's costs."""
    rng = random.Random(9)
    samples = []
    for w in mixed_steps(rng, 400):
        stall = rng.uniform(3, 6) if rng.random() < 1 / 8 else 1.0
        samples.append((w, TRUE.step_seconds(w) * rng.uniform(0.98, 1.02) * stall))
    median = fit_linear(samples, median=True)
    for name in ("step_s", "prefill_token_s", "decode_seq_s", "context_token_s"):
        assert getattr(median, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    assert fit_linear(samples).step_s > 1.3 * TRUE.step_s
