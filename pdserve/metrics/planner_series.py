"""What the router's online planner chose (`PLANNER_*`, `observe_plan`) and the role switches
it made (`ROLE_SWITCH*`, `observe_role_switch`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from pdserve.metrics.buckets import TRANSFER_BUCKETS

# --- online planner (router, --plan-interval; router/online_plan.py) --------------------------
PLANNER_WORKERS = Gauge(
    "pdserve_planner_workers",
    "Workers of each role in the split the online planner chose for the last window "
    "(role: prefill, decode; prefill 0 = colocated).",
    ["role"],
)
PLANNER_GOODPUT_RPS = Gauge(
    "pdserve_planner_goodput_rps",
    "Predicted goodput (requests/s meeting both SLOs) of the chosen split on the last window.",
)
PLANNER_OBSERVED_RPS = Gauge(
    "pdserve_planner_observed_rps", "Requests/s the router served in the last window."
)
PLANNER_WORKERS_NEEDED = Gauge(
    "pdserve_planner_workers_needed",
    "Workers the observed rate needs if goodput scales with the worker count (an estimate).",
)


def observe_plan(plan: dict[str, Any]) -> None:
    """Exports one online plan (pdserve/planner/online.py's answer)."""
    PLANNER_WORKERS.labels("prefill").set(plan["prefill_workers"])
    PLANNER_WORKERS.labels("decode").set(plan["decode_workers"])
    PLANNER_GOODPUT_RPS.set(plan["goodput_rps"])
    PLANNER_OBSERVED_RPS.set(plan["observed_rps"])
    if plan.get("workers_for_observed") is not None:
        PLANNER_WORKERS_NEEDED.set(plan["workers_for_observed"])


# --- role switching (router, --role-switching; router/role_switch.py) -------------------------
ROLE_SWITCHES = Counter(
    "pdserve_role_switches",
    "Workers that changed role without a restart (worker; to_role: prefill, decode).",
    ["worker", "to_role"],
)
ROLE_SWITCH_SECONDS = Histogram(
    "pdserve_role_switch_seconds",
    "How long a role switch took, its drain included.",
    buckets=TRANSFER_BUCKETS,
)
ROLE_SWITCH_BLOCKS_KEPT = Gauge(
    "pdserve_role_switch_blocks_kept",
    "Blocks of the worker's prefix cache kept through its last role switch.",
    ["worker"],
)


def observe_role_switch(switch: Any) -> None:
    """Exports one router.role_switch.RoleSwitch."""
    ROLE_SWITCHES.labels(worker=switch.worker_id, to_role=switch.to_role).inc()
    ROLE_SWITCH_SECONDS.observe(switch.seconds)
    ROLE_SWITCH_BLOCKS_KEPT.labels(worker=switch.worker_id).set(switch.blocks_kept)
