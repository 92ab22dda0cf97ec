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
