"""`pdserve bench engine-mixed`: a seeded ShareGPT-like workload through both engines."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pdserve.bench.engine.mixed_engine_bench import (
    SHAREGPT_MEAN_INPUT,
    SHAREGPT_MEAN_OUTPUT,
    lognormal_lengths,
    mixed_requests,
)
from pdserve.cli import main


def test_workload_is_a_function_of_its_seed():
    first = mixed_requests(16, 512, 0.25, 1.0, 512, seed=3)
    assert first == mixed_requests(16, 512, 0.25, 1.0, 512, seed=3)
    assert first != mixed_requests(16, 512, 0.25, 1.0, 512, seed=4)
    assert all(3 <= t < 512 for r in first for t in r.prompt)


def test_lengths_have_sharegpt_means_scaled_and_stay_in_bounds():
    rng = np.random.default_rng(0)
    for mean in (SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT):
        lengths = lognormal_lengths(rng, mean, 1.0, 50_000, longest=100_000)
        assert np.mean(lengths) == pytest.approx(mean, rel=0.05)
        # Heavy-tailed: the median is the mean / exp(sigma^2 / 2).
        assert np.median(lengths) == pytest.approx(mean / np.exp(0.5), rel=0.05)
    clipped = lognormal_lengths(rng, 200.0, 1.0, 1000, longest=64)
    assert min(clipped) >= 2 and max(clipped) == 64


def test_bench_prints_both_engines_and_their_ratio(capsys):
    argv = ["bench", "engine-mixed", "--preset", "tiny", "--requests", "5"]
    assert main([*argv, "--batch-size", "2", "--length-scale", "0.05", "--max-len", "12"]) == 0
    out = capsys.readouterr().out
    assert "5 requests, batch size 2, float32" in out
    rows = dict(re.findall(r"^(pdserve|transformers) .*? ([\d.]+)\s+[\d.]+\s+[\d.]+$", out, re.M))
    assert set(rows) == {"pdserve", "transformers"}
    ratio = float(re.search(r"ratio \(requests/s\) ([\d.]+)x", out).group(1))
    # The seconds are printed to 3 decimals: at a few milliseconds that rounding alone moves
    # their quotient by several percent, so the ratio must lie within what they allow.
    theirs, ours, half = float(rows["transformers"]), float(rows["pdserve"]), 0.0005
    assert (
        (theirs - half) / (ours + half) - 0.005 <= ratio <= (theirs + half) / (ours - half) + 0.005
    )
