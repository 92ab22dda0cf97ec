"""The online planner (--plan-interval) and role switching (--role-switching), started beside the
router when their flags ask for them."""

from __future__ import annotations

from pathlib import Path

from pdserve.config import ServeConfig
from pdserve.prefix_index.lookup import PrefixIndex
from router.policy import RoutingPolicy
from router.routing import Routing
from router.worker_pool import WorkerPool


def start_planner(
    config: ServeConfig,
    model_dir: Path,
    pool: WorkerPool,
    policy: RoutingPolicy,
    index: PrefixIndex,
):
    """--plan-interval: the online planner over this router's traffic and measured costs, started;
    None without the flag."""
    router = config.router
    if not router.plan_interval_s:
        return None
    from router.online_plan import OnlinePlanner, PlanSettings

    engine = config.engine_for("decode")
    settings = PlanSettings(
        model_dir=str(model_dir),
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        dtype=engine.dtype,
        ttft_slo_ms=router.ttft_slo_ms,
        tpot_slo_ms=router.tpot_slo_ms,
    )
    return OnlinePlanner(
        router.plan_interval_s,
        settings,
        policy.cost,
        lambda: [w.stats for w in pool.workers.values() if w.stats],
        publish=lambda plan: index.in_background(index.publish_plan, plan),  # off the loop
    ).start()


def start_role_switching(config: ServeConfig, pool: WorkerPool, routing: Routing, planner):
    """--role-switching: workers move between roles towards the online planner's split; None
    without the flag."""
    router = config.router
    if not router.role_switching:
        return None
    from router.role_hysteresis import RoleHysteresis
    from router.role_switch import RoleSwitcher

    role_switcher = RoleSwitcher(
        pool,
        routing.roles_changed,
        RoleHysteresis(router.role_switch_dwell_s, router.role_switch_margin),
        router.role_switch_drain_s,
    )
    planner.listeners.append(role_switcher.on_plan)
    return role_switcher
