"""A small plan (4 workers, 200 requests) runs in seconds and points the way the timing model
says it should: colocated for short prompts at loose SLOs, disaggregated for long prompts
under a TPOT target that a step carrying a prefill chunk cannot meet."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO
from pdserve.planner.search import Plan, Search
from pdserve.planner.splits import all_splits
from pdserve.planner.workload import PlanRequest, probe_sample
from pdserve.sim.timing import Chunk, StepWork

WORKERS = 4
BATCH = 16


@pytest.fixture(scope="module")
def deployment(planner_model_dir) -> Deployment:
    return Deployment(str(planner_model_dir), max_num_seqs=BATCH, max_num_batched_tokens=2048)


def _plan(deployment: Deployment, prompt_len: int, output_len: int, slo: SLO) -> Plan:
    workload = [PlanRequest(prompt_len, output_len) for _ in range(200)]
    sample = probe_sample(workload, len(workload), seed=1)
    router = RouterConfig(ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms)
    search = Search(deployment, sample, slo, router, precision=0.2, top=2, requests_per_worker=100)
    return search.run(all_splits(WORKERS))


def _step_ms(deployment: Deployment, chunks: list[Chunk]) -> float:
    timing = deployment.new_engine()[1].timing
    return 1e3 * timing.step_seconds(StepWork.of(chunks, len(chunks)))


def test_short_prompts_at_loose_slos_stay_colocated(planner_model_dir):
    prompt_len, output_len = 64, 32
    slo = SLO(ttft_ms=250, tpot_ms=50)
    # Every worker's KV pool holds BATCH requests (6 blocks each), prefill or decode alike,
    # and a step that also prefills one prompt is as fast as a decode-only one, far within
    # the TPOT target: a prefill worker's GPU would idle while decode workers did the work.
    deployment = Deployment(str(planner_model_dir), max_num_seqs=BATCH, num_kv_blocks=BATCH * 6)
    decodes = [Chunk(prompt_len, 1, True)] * BATCH
    with_prefill = _step_ms(deployment, [Chunk(0, prompt_len, False), *decodes])
    assert with_prefill < 1.2 * _step_ms(deployment, decodes) < slo.tpot_ms

    plan = _plan(deployment, prompt_len, output_len, slo)

    assert plan.recommended.split.prefill == 0
    assert not any(r.saturated for r in plan.results)  # every goodput is a measured one


def test_long_prompts_under_a_tight_tpot_target_disaggregate(deployment):
    prompt_len, output_len = 2000, 32
    slo = SLO(ttft_ms=3000, tpot_ms=12)
    # Decoding alone meets the TPOT target; a step that carries a prefill chunk overshoots it
    # several times, so colocated decodes miss it whenever prompts keep arriving.
    decodes = [Chunk(prompt_len, 1, True)] * BATCH
    assert _step_ms(deployment, decodes) < slo.tpot_ms
    chunk = deployment.engine_config.max_num_batched_tokens - BATCH
    assert _step_ms(deployment, [Chunk(0, chunk, False), *decodes]) > 3 * slo.tpot_ms

    plan = _plan(deployment, prompt_len, output_len, slo)

    chosen = plan.recommended
    colocated = next(r for r in plan.results if r.split.prefill == 0)
    assert chosen.split.prefill > 0
    assert chosen.goodput > colocated.goodput * (1 + plan.precision)
