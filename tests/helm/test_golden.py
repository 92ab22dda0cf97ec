"""Golden renders: helm/pdserve/examples/golden/<case>.yaml is what the chart renders for the
default values and each example, so any change to the rendered YAML shows up in review.

After a deliberate change, rewrite them and review the diff:
    PDSERVE_UPDATE_GOLDEN=1 pytest tests/helm/test_golden.py
"""

from __future__ import annotations

import difflib
import os

import pytest

from tests.helm.render import CASES, GOLDEN_DIR, render_case

UPDATE = os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("case", CASES)
def test_render_matches_golden(case):
    actual = render_case(case).golden_text()
    path = GOLDEN_DIR / f"{case}.yaml"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
    assert path.exists(), f"missing {path}; run with PDSERVE_UPDATE_GOLDEN=1 to create it"
    expected = path.read_text()
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(True), actual.splitlines(True), str(path), "rendered", n=2
            )
        )
        pytest.fail(
            f"rendered chart differs from {path.name} (if deliberate, rerun with "
            f"PDSERVE_UPDATE_GOLDEN=1 and commit the new golden):\n{diff[:6000]}"
        )


def test_every_example_has_a_golden_and_no_stale_ones():
    examples = {p.stem for p in GOLDEN_DIR.parent.glob("*.yaml")}
    assert examples == set(CASES) - {"default"}
    assert {p.stem for p in GOLDEN_DIR.glob("*.yaml")} == set(CASES)
