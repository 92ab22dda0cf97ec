"""The GPU-measured profiles committed in docs/profiles: each loads as a --sim-profile, and its
coefficients still price the steps it was fitted on (recorded beside it) as the fit reported.
So a change to the profile format, to StepWork's accounting or to LinearTiming that would make
the committed measurements mean something else fails here."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pdserve.sim.profiles import parse_profile, timing_model
from pdserve.sim.shapes import shape_config
from pdserve.sim.timing import Chunk, StepWork

PROFILES = Path(__file__).resolve().parents[2] / "docs" / "profiles"
MEASURED = sorted(p for p in PROFILES.glob("*.json") if not p.name.endswith("-steps.json"))


def _fastest_steps(profile: Path) -> dict[StepWork, float]:
    """The fastest recorded time of each distinct step, as the fit keeps them."""
    rows = json.loads(profile.with_name(profile.stem + "-steps.json").read_text())
    fastest: dict[StepWork, float] = {}
    for row in rows:
        work = StepWork.of([Chunk(*c) for c in row["chunks"]], row["num_sampled"])
        fastest[work] = min(row["s"], fastest.get(work, row["s"]))
    return fastest


def test_there_is_a_measured_profile():
    assert MEASURED, f"no measured profile in {PROFILES}"


@pytest.mark.parametrize("profile", MEASURED, ids=lambda p: p.stem)
def test_measured_profile_prices_its_own_steps(profile):
    timing = timing_model(parse_profile(str(profile)), shape_config("llama-3.1-8b"), "bfloat16")
    fastest = _fastest_steps(profile)  # the fit's median error on these was 19%
    errors = [abs(timing.step_seconds(w) - s) / s for w, s in fastest.items()]
    assert statistics.median(errors) < 0.25
    # The whole prefills (thousands of prompt tokens) are where the per-token term decides.
    prefills = [(w, s) for w, s in fastest.items() if w.prefill_tokens >= 8192]
    assert prefills
    for work, seconds in prefills:
        assert timing.step_seconds(work) == pytest.approx(seconds, rel=0.3)


def test_analytical_h200_prefill_is_within_30_percent_of_the_measured_one():
    """The roofline's compute term against a real H200's whole prefills (8k-65k tokens)."""
    profile = PROFILES / "h200-llama-3.1-8b-bf16-eager.json"
    roofline = timing_model(
        parse_profile("analytical:h200"), shape_config("llama-3.1-8b"), "bfloat16"
    )
    prefills = [(w, s) for w, s in _fastest_steps(profile).items() if w.prefill_tokens >= 8192]
    ratios = [roofline.step_seconds(w) / s for w, s in prefills]
    assert len(prefills) == 3 and all(0.7 < r < 1.0 for r in ratios), ratios
