"""The virtual-clock cluster runs pdserve's own engines and router: the tokens are the in-process
sim engine's, every handoff ends with no block left in use, and the clock moves by the
modelled step times."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SimConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.workload import PlanRequest, probe_sample
from pdserve.sim.timing import Chunk, StepWork

LOOSE = SLO(ttft_ms=1e6, tpot_ms=1e6)


@pytest.fixture(scope="module")
def deployment(planner_model_dir) -> Deployment:
    return Deployment(
        str(planner_model_dir), max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256
    )


def _requests(count: int) -> list[PlanRequest]:
    return [PlanRequest(5 + 17 * i % 90, 1 + i % 12) for i in range(count)]


@pytest.mark.parametrize(
    ("split", "disaggregate"),
    [
        (Split(0, 2), "never"),
        (Split(1, 1), "always"),
        (Split(2, 2), "auto"),
        # Hybrid workers (--hybrid): every prefill on another worker, then the router's choice.
        (Split(0, 3, hybrid=True), "always"),
        (Split(0, 3, hybrid=True), "auto"),
    ],
)
def test_every_split_produces_the_in_process_sim_engines_tokens(
    deployment, planner_model_dir, split, disaggregate
):
    sample = probe_sample(_requests(24), 24, seed=3)
    reference = LLMEngine(
        EngineConfig(
            model=str(planner_model_dir),
            kind="sim",
            dtype="bfloat16",
            num_kv_blocks=256,
            sim=SimConfig(time_scale=1e-6),
        )
    )
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in sample]
    expected = reference.generate([r.prompt for r in sample], params)

    router = RouterConfig(disaggregate=disaggregate, ttft_slo_ms=1e6, tpot_slo_ms=1e6)
    result, runs = run_probe(
        deployment, split, sample, 40.0, LOOSE, router, stop_when_certain=False, keep_tokens=True
    )

    assert [run.tokens for run in runs] == expected
    assert all(run.record.ok for run in runs) and result.passed and result.complete
    remote = [run for run in runs if run.route.prefill_worker]
    if disaggregate == "always":
        assert len(remote) == len(runs)
    if disaggregate == "never":
        assert not remote
    assert all(run.route.prefill_worker != run.route.decode_worker for run in remote)
    if split.hybrid and disaggregate == "always":  # every worker prefilled for the others
        assert {run.route.prefill_worker for run in remote} == {"hybrid-0", "hybrid-1", "hybrid-2"}
    cluster_workers = runs[0].cluster.workers.values()
    assert all(w.engine.stats()["num_used_blocks"] == 0 for w in cluster_workers)


def test_the_clock_moves_by_the_modelled_step_times(deployment):
    prompt_len, output_len = 40, 3
    sample = probe_sample([PlanRequest(prompt_len, output_len)], 1)
    result, runs = run_probe(
        deployment, Split(0, 1), sample, 1.0, LOOSE, RouterConfig(), stop_when_certain=False
    )
    timing = deployment.new_engine()[1].timing
    prefill = timing.step_seconds(StepWork.of([Chunk(0, prompt_len, False)], 1))
    decodes = [
        timing.step_seconds(StepWork.of([Chunk(prompt_len + i, 1, True)], 1))
        for i in range(output_len - 1)
    ]
    record = runs[0].record
    assert record.ttft == pytest.approx(prefill, rel=1e-9)
    assert record.e2e == pytest.approx(prefill + sum(decodes), rel=1e-9)
    assert result.decode_utilisation == pytest.approx(1.0)


def test_a_push_pays_its_fixed_cost_besides_its_bytes(deployment, planner_model_dir):
    """A deployment's `push_fixed_s` (the RPCs a measured push took besides its bytes) delays
    each handoff's second token by exactly that much on otherwise idle workers."""
    fixed = Deployment(
        str(planner_model_dir),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_kv_blocks=256,
        push_fixed_s=0.05,
    )

    def second_token_wait(d: Deployment) -> float:
        sample = probe_sample([PlanRequest(64, 2)], 1)
        router = RouterConfig(disaggregate="always")
        _, runs = run_probe(d, Split(1, 1), sample, 1.0, LOOSE, router, stop_when_certain=False)
        first, second = runs[0].record.chunk_times[:2]
        return second - first

    assert fixed.push_seconds(0) == 0.05 and deployment.push_seconds(0) == 0.0
    assert second_token_wait(fixed) - second_token_wait(deployment) == pytest.approx(0.05)


def test_a_handoff_takes_the_kv_bytes_over_the_link(deployment):
    prompt_len = 64  # four full blocks of 16: all of them travel
    sample = probe_sample([PlanRequest(prompt_len, 2)], 1)
    router = RouterConfig(disaggregate="always")
    _, runs = run_probe(
        deployment, Split(1, 1), sample, 1.0, LOOSE, router, stop_when_certain=False
    )
    timing = deployment.new_engine()[1].timing
    prefill = timing.step_seconds(StepWork.of([Chunk(0, prompt_len, False)], 1))
    engine = runs[0].cluster.workers["prefill-0"].engine
    transfer = 4 * engine.bytes_per_block / deployment.link_bytes_per_s
    record = runs[0].record
    # The first token does not wait for the push (prefill_service/worker.py); the second does.
    assert record.ttft == pytest.approx(prefill, rel=1e-9)
    assert record.chunk_times[1] - record.chunk_times[0] > transfer
