"""A probe judges a TPOT miss as soon as it is certain: when a request's remaining tokens, one
step each and no step shorter than the timing model's bound, cannot end it by its deadline.
Such early misses are real misses (the counts equal those of a run to the end), and they stop
an overloaded probe before the deadlines alone would."""

from __future__ import annotations

import random

import pytest

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.workload import PlanRequest, probe_sample
from pdserve.sim.timing import Chunk, LinearTiming, StepWork
from pdserve.workloads.metrics import meets_slo

# TTFT out of reach of a miss: every miss here is a TPOT one.
SLO_TPOT = SLO(ttft_ms=1e6, tpot_ms=20.0, attainment=0.9)
_LATE = 1e-9  # probe.py's tolerance past a deadline


@pytest.fixture(scope="module")
def deployment(planner_model_dir) -> Deployment:
    # Few sequences a step: committed handoffs beyond them wait in place, missing their TPOT.
    return Deployment(
        str(planner_model_dir), max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=2048
    )


def _sample():
    requests = [PlanRequest(20 + 7 * i % 40, 30 + 11 * i % 50) for i in range(120)]
    return probe_sample(requests, len(requests), seed=5)


def test_early_tpot_misses_are_misses_and_stop_the_probe_sooner(deployment):
    sample = _sample()
    router = RouterConfig(disaggregate="always", ttft_slo_ms=1e6, tpot_slo_ms=20.0)
    full, runs = run_probe(
        deployment, Split(1, 1), sample, 400.0, SLO_TPOT, router, stop_when_certain=False
    )
    records = [run.record for run in runs]
    met = sum(meets_slo(r, SLO_TPOT.ttft_ms, SLO_TPOT.tpot_ms) for r in records)
    # Every request was judged once, and as it turned out: no early miss met its targets.
    assert (full.good, full.missed) == (met, len(records) - met)
    assert not full.passed

    # Without the bound a request's miss is known at its deadline: the probe would stop when
    # the misses first exceed what the attainment allows.
    deadlines = sorted(
        r.chunk_times[0] + SLO_TPOT.tpot_ms / 1e3 * (r.max_tokens - 1) * (1 + _LATE) + _LATE
        for r in records
        if not meets_slo(r, SLO_TPOT.ttft_ms, SLO_TPOT.tpot_ms)
    )
    start = min(r.send_time for r in records)
    allowed = full.requests - 108  # 90% of 120 must meet both
    stopped, _ = run_probe(deployment, Split(1, 1), sample, 400.0, SLO_TPOT, router)
    assert not stopped.passed and stopped.missed == allowed + 1
    assert start + stopped.elapsed_s < deadlines[allowed]


def test_no_step_that_samples_is_shorter_than_the_bound(deployment):
    timing = deployment.new_engine()[1].timing
    linear = LinearTiming(
        step_s=0.004, prefill_token_s=2e-5, decode_seq_s=1e-4, context_token_s=1e-8
    )
    rng = random.Random(0)
    for model in (timing, linear):
        bound = model.min_sampling_step_seconds()
        assert bound > 0
        smallest = model.step_seconds(StepWork.of([Chunk(0, 1, False)], 1))
        assert smallest >= bound
        for _ in range(200):
            chunks = [
                Chunk(rng.randrange(0, 4000), rng.randrange(1, 300), False)
                for _ in range(rng.randrange(0, 3))
            ]
            chunks += [Chunk(rng.randrange(1, 4000), 1, True) for _ in range(rng.randrange(0, 64))]
            if chunks:
                sampled = rng.randrange(1, len(chunks) + 1)
                assert model.step_seconds(StepWork.of(chunks, sampled)) >= bound


def test_a_fit_with_a_negative_coefficient_bounds_nothing():
    fit = LinearTiming(step_s=0.004, prefill_token_s=2e-5, decode_seq_s=-1e-6, context_token_s=0)
    assert fit.min_sampling_step_seconds() == 0.0
