"""RoleHysteresis: an online plan moves a worker only past the dwell time and the gain margin,
so an oscillating planner cannot make workers flap."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig, ServeConfig
from pdserve.config_fields import ConfigError
from pdserve.planner.probe import Split
from router.role_hysteresis import RoleHysteresis, split_name


def plan(prefill: int, decode: int, goodputs: dict[str, float]) -> dict:
    name = split_name(prefill, decode)
    return {
        "workers": prefill + decode,
        "recommended": name,
        "prefill_workers": prefill,
        "decode_workers": decode,
        "goodput_rps": goodputs[name],
        "splits": [{"split": s, "goodput_rps": g, "pruned": False} for s, g in goodputs.items()],
    }


def run(hysteresis: RoleHysteresis, plans: list[dict], every_s: float) -> list[tuple[str, int]]:
    """Feeds one plan every `every_s` seconds to a 4-worker cluster starting at 1P:3D, moving
    workers as told (switches complete at once); returns the moves (role, workers)."""
    prefill, moves = 1, []
    for i, answer in enumerate(plans):
        target = hysteresis.target(answer, prefill, 4 - prefill, now=i * every_s)
        if target is not None:
            hysteresis.switched(i * every_s)
            to_role, count = target
            prefill += count if to_role == "prefill" else -count
            moves.append(target)
    return moves


GOODPUTS = {"colocated 4": 5.0, "1P:3D": 10.0, "2P:2D": 12.0, "3P:1D": 20.0}
TO_3P = plan(3, 1, GOODPUTS)
TO_1P = plan(1, 3, {**GOODPUTS, "1P:3D": 25.0})


def test_an_oscillating_plan_moves_a_worker_at_most_once_per_dwell():
    flapping = [TO_3P, TO_1P] * 30  # the plan flips every 10 s for 10 minutes
    moves = run(RoleHysteresis(dwell_s=120.0, margin=0.1), flapping, every_s=10.0)
    assert 1 <= len(moves) <= 600 / 120
    # Without a dwell the same signal flips a worker at every plan: what the dwell prevents.
    assert len(run(RoleHysteresis(dwell_s=0.0, margin=0.1), flapping, every_s=10.0)) >= 40


def test_a_steady_plan_is_reached_in_one_switch_then_kept():
    moves = run(RoleHysteresis(dwell_s=30.0, margin=0.1), [TO_3P] * 10, every_s=10.0)
    assert moves == [("prefill", 2)]  # 1P:3D -> 3P:1D, both workers drained together


def test_a_gain_within_the_margin_moves_nothing():
    close = plan(2, 2, {**GOODPUTS, "2P:2D": 10.5})  # 5% over 1P:3D's 10 req/s
    hysteresis = RoleHysteresis(dwell_s=0.0, margin=0.1)
    assert run(hysteresis, [close] * 5, every_s=10.0) == []
    assert "does not beat 1P:3D (10.00 req/s) by 10%" in hysteresis.held_because


def test_a_failed_plan_or_one_for_another_worker_count_moves_nothing():
    hysteresis = RoleHysteresis(dwell_s=0.0, margin=0.0)
    assert hysteresis.target({"error": "too few requests"}, 1, 3, now=0.0) is None
    assert hysteresis.target(plan(3, 2, {"3P:2D": 9.0}), 1, 3, now=0.0) is None
    assert "planned for 5 workers" in hysteresis.held_because


def test_split_names_match_the_planners():
    for prefill, decode in [(0, 4), (1, 3), (3, 1)]:
        assert split_name(prefill, decode) == Split(prefill, decode).name


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"router": RouterConfig(role_switching=True, plan_interval_s=5.0), "decode_tp": 2},
            "same engine and TP",
        ),
        (
            {
                "router": RouterConfig(role_switching=True, plan_interval_s=5.0),
                "decode_engine": "sim",
            },
            "same engine and TP",
        ),
    ],
)
def test_role_switching_needs_one_engine_for_both_pools(changes, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**changes)


def test_role_switching_needs_the_online_planner():
    with pytest.raises(ConfigError, match="role_switching: needs --plan-interval"):
        RouterConfig(role_switching=True)
