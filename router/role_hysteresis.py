"""RoleHysteresis: whether an online plan is worth a worker changing role, and to which role.

The same decision for the live router (router/role_switch.py) and the simulated cluster
(pdserve/planner/role_switching.py). It moves the workers the planned split needs, in one
switch (their drains run together; `pick_workers`: those with the fewest requests in flight),
and only when
  - at least `dwell_s` passed since the last switch began (a role, once taken, is kept that
    long: an oscillating plan cannot make a worker flap faster than that), and
  - the plan's goodput for its split beats the current split's, as the same plan priced it, by
    more than `margin` (a plan that is merely different is no reason to pay a drain).
A plan made for another worker count than the one routed now (a worker down) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.worker_pool import Worker, WorkerPool


def split_name(prefill: int, decode: int) -> str:
    """The planner's name of a split of TP-1 workers (pdserve/planner/probe.py, Split.name)."""
    return f"colocated {decode}" if prefill == 0 else f"{prefill}P:{decode}D"


@dataclass
class RoleHysteresis:
    dwell_s: float
    margin: float
    last_switch_at: float = float("-inf")
    # Why the last plan led to no switch (for the log and the tests); "" after a switch.
    held_because: str = ""

    def target(
        self, plan: dict[str, Any], prefill: int, decode: int, now: float
    ) -> tuple[str, int] | None:
        """The role workers should move to ("prefill" or "decode") and how many, or None to
        stay."""
        self.held_because = self._why_not(plan, prefill, decode, now)
        if self.held_because:
            return None
        wanted = plan["prefill_workers"]
        return ("prefill" if wanted > prefill else "decode"), abs(wanted - prefill)

    def switched(self, now: float) -> None:
        """A switch began at `now`."""
        self.last_switch_at = now

    def _why_not(self, plan: dict[str, Any], prefill: int, decode: int, now: float) -> str:
        if "error" in plan:
            return f"no plan: {plan['error']}"
        if plan["workers"] != prefill + decode:
            return f"planned for {plan['workers']} workers, {prefill + decode} are routed"
        if plan["prefill_workers"] == prefill:
            return "the plan is the current split"
        waited = now - self.last_switch_at
        if waited < self.dwell_s:
            return f"{waited:.0f} s since the last switch, dwell {self.dwell_s:g} s"
        goodputs = {s["split"]: s["goodput_rps"] for s in plan.get("splits", [])}
        current = goodputs.get(split_name(prefill, decode), 0.0)
        if plan["goodput_rps"] <= current * (1 + self.margin):
            return (
                f"{plan['recommended']} ({plan['goodput_rps']:.2f} req/s) does not beat "
                f"{split_name(prefill, decode)} ({current:.2f} req/s) by {self.margin:.0%}"
            )
        return ""


def pick_workers(pool: WorkerPool, to_role: str, count: int) -> list[str]:
    """Up to `count` workers to move to `to_role`: of the other role, those cheapest to drain
    (the fewest requests in flight); the last decode worker stays."""
    from_role = "decode" if to_role == "prefill" else "prefill"
    candidates = sorted((w for w in pool.of_role(from_role) if w.routable), key=_inflight)
    if to_role == "prefill":
        count = min(count, len(candidates) - 1)
    return [w.worker_id for w in candidates[: max(count, 0)]]


def _inflight(worker: Worker) -> int:
    return worker.inflight
