"""Role switching on the virtual cluster: the router's own decision (RoleHysteresis) and drain
(WorkerPool.drain, Routing.roles_changed) on the virtual clock; workers move both ways under
load, every request completes with the in-process sim engine's tokens, no block stays in use
and the moved workers keep their prefix caches."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SimConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.role_switching import VirtualRoleSwitcher
from pdserve.planner.workload import PlanRequest, probe_sample
from router.role_hysteresis import RoleHysteresis, split_name

LOOSE = SLO(ttft_ms=1e6, tpot_ms=1e6)


@pytest.fixture(scope="module")
def deployment(planner_model_dir) -> Deployment:
    return Deployment(
        str(planner_model_dir), max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256
    )


def plan(prefill: int) -> dict:
    """A plan for 4 workers recommending `prefill` of them, at twice every other split's
    goodput."""
    splits = [{"split": split_name(p, 4 - p), "goodput_rps": 10.0} for p in range(4)]
    splits[prefill]["goodput_rps"] = 20.0
    return {
        "workers": 4,
        "recommended": split_name(prefill, 4 - prefill),
        "prefill_workers": prefill,
        "decode_workers": 4 - prefill,
        "goodput_rps": 20.0,
        "splits": splits,
    }


def test_workers_switch_both_ways_under_load_and_every_request_completes(
    deployment, planner_model_dir
):
    sample = probe_sample([PlanRequest(20 + 13 * i % 70, 4 + i % 20) for i in range(80)], 80, 5)
    reference = LLMEngine(
        EngineConfig(
            model=str(planner_model_dir), kind="sim", dtype="bfloat16", num_kv_blocks=256,
            sim=SimConfig(time_scale=1e-6),
        )
    )  # fmt: skip
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in sample]
    expected = reference.generate([r.prompt for r in sample], params)
    plans_handed: list[int] = []

    def plan_of(window) -> dict:
        # The planner's signal flips between 3P:1D and 1P:3D at every plan.
        wanted = 3 if len(plans_handed) % 2 == 0 else 1
        plans_handed.append(wanted)
        return plan(wanted)

    made: list[VirtualRoleSwitcher] = []

    def attach(cluster):
        made.append(VirtualRoleSwitcher(cluster, RoleHysteresis(0.05, 0.1), plan_of, 0.02, 5.0))
        return made[0].start().arrived

    router = RouterConfig(disaggregate="always", ttft_slo_ms=1e6, tpot_slo_ms=1e6)
    result, runs = run_probe(
        deployment, Split(2, 2), sample, 200.0, LOOSE, router,
        stop_when_certain=False, keep_tokens=True, attach=attach,
    )  # fmt: skip

    assert [run.tokens for run in runs] == expected
    assert all(run.record.ok for run in runs) and result.complete
    switcher = made[0]
    moved = {s.to_role for s in switcher.switches}
    assert moved == {"prefill", "decode"}, switcher.switches
    # The dwell holds: no two switches closer than it, though the plan flipped every interval.
    starts = sorted({s.at_s for s in switcher.switches})
    assert all(b - a >= 0.05 for a, b in zip(starts, starts[1:], strict=False))
    # Plans are asked for only between drains, so whether one falls within the dwell depends
    # on how long the drains take, which is the routing's doing (3 plans, 3 switches since the
    # cost policy's ties are two random choices).
    assert len(starts) <= len(plans_handed)
    assert any(s.blocks_kept > 0 for s in switcher.switches)
    cluster = runs[0].cluster
    assert all(w.engine.stats()["num_used_blocks"] == 0 for w in cluster.workers.values())
    assert all(w.inflight == 0 and not w.draining for w in cluster.pool.workers.values())
    # The pool's lists, routing's rows and the workers' own roles agree.
    for role in ("prefill", "decode"):
        listed = {w.worker_id for w in cluster.pool.of_role(role, healthy_only=False)}
        assert listed == {w.worker_id for w in cluster.workers.values() if w.role == role}
        assert listed == {load.worker_id for load in cluster.router_of(0)._rows[role]}
    # Requests ran on a moved worker in its new role.
    switched = {s.worker_id for s in switcher.switches if s.to_role == "prefill"}
    assert {run.route.prefill_worker for run in runs} & switched
