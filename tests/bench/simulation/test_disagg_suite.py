"""`pdserve bench sim-disagg --suite`: its workloads, one cheap cell on the virtual cluster, and
the targets it checks."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.bench.simulation.disagg_suite.command import _split_names
from pdserve.bench.simulation.disagg_suite.suite import (
    MODELS,
    Cell,
    FamilyBest,
    Setting,
    SuiteOptions,
    family_splits,
    run_cell,
    search_deployments,
)
from pdserve.bench.simulation.disagg_suite.targets import targets
from pdserve.bench.simulation.disagg_suite.workloads import WORKLOADS, suite_sample


def test_agentic_sessions_grow_a_shared_context() -> None:
    sample = suite_sample("agentic", 64)
    by_session: dict[str, list] = {}
    for r in sample:
        by_session.setdefault(r.tag, []).append(list(r.prompt))
    for turns in by_session.values():
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert len(later) > len(earlier) and later[: len(earlier)] == earlier


def test_phases_change_the_mix_and_mix_holds_every_kind() -> None:
    phases = suite_sample("phases", 400)
    quarters = [Counter(_kind(r) for r in phases[i * 100 : (i + 1) * 100]) for i in range(4)]
    assert [q.most_common(1)[0][0] for q in quarters] == ["chat", "code", "rag", "agentic"]
    assert all(len(q) == 1 for q in quarters)
    mix = Counter(_kind(r) for r in suite_sample("mix", 400))
    assert set(mix) == {"chat", "code", "rag", "agentic"} and min(mix.values()) >= 80
    arrivals = [r.unit_arrival for r in phases]
    assert arrivals == sorted(arrivals)


def test_long_rag_is_run_by_name_with_prompts_past_rag() -> None:
    lengths = [len(r.prompt) for r in suite_sample("long-rag", 200)]
    assert min(lengths) >= 6144 and max(lengths) <= 10240
    assert max(len(r.prompt) for r in suite_sample("rag", 200)) <= 6144
    assert "long-rag" not in WORKLOADS  # not one of the suite's default cells


def _kind(r) -> str:
    return r.tag.split(":")[0]


def test_one_cell_searches_every_split_at_every_setting() -> None:
    settings = (Setting(512, 64), Setting(2048, 64))
    options = SuiteOptions(settings, requests_per_worker=30, precision=0.2,
                           families=("colocated", "split"), steady_probes=False)  # fmt: skip
    cell = run_cell("70b", "code", "loose", options)
    colocated, split = cell.families["colocated"], cell.families["split"]
    assert len(colocated.searched) == 2 and len(split.searched) == 6  # 1:3, 2:2, 3:1 twice
    assert colocated.goodput == max(colocated.searched.values()) > 0
    assert split.goodput == max(split.searched.values()) > 0
    assert colocated.setting in settings and split.split.endswith(("1D (TP 4:4)", "3D (TP 4:4)",
                                                                    "2D (TP 4:4)"))  # fmt: skip
    # 70B code on 16 H100s: the GPUs' FLOPs bound it to tens of requests/s, not thousands.
    assert cell.ceiling is not None and 1 < cell.ceiling < 1000


def test_targets() -> None:
    cell = Cell("8b", "code", "loose")
    for family, goodput in [("colocated", 100.0), ("split", 60.0), ("auto", 96.0),
                            ("threshold", 97.0)]:  # fmt: skip
        cell.families[family] = FamilyBest(family, goodput)
    assert targets(cell) == {
        "auto>=0.95x best static": True,
        "auto>=1.0x colocated": False,
        "auto>=threshold": False,
    }
    # The same rate reached along another product of steps still meets the target.
    cell.families["threshold"] = FamilyBest("threshold", 96.0 * (1 + 1e-15))
    assert targets(cell)["auto>=threshold"]
    cell.families["threshold"] = FamilyBest("threshold", 97.0)
    assert cell.above_ceiling() == []  # no ceiling known
    cell.ceiling = 96.5
    assert cell.above_ceiling() == ["colocated", "threshold"]


def test_splits_narrow_the_search_and_bad_ones_are_named() -> None:
    options = SuiteOptions((Setting(2048, 64),), requests_per_worker=30, precision=0.2,
                           families=("colocated", "split"), steady_probes=False,
                           splits=("3:1",))  # fmt: skip
    cell = run_cell("70b", "code", "loose", options)
    assert len(cell.families["colocated"].searched) == 1  # colocated is never narrowed
    assert list(cell.families["split"].searched) == ["3P:1D (TP 4:4) chunk 2048 batch 64"]
    with pytest.raises(ValueError, match=r"--splits: 1:7 is not a split of 70b \(1:3, 2:2, 3:1\)"):
        _split_names("1:7", ["70b"])
    with pytest.raises(ValueError, match="--splits: 'x' is not P:D"):
        _split_names("x", ["8b"])
    assert _split_names("1:7, 2:6", ["8b"]) == ("1:7", "2:6")


def test_auto_also_searches_every_worker_hybrid_and_says_how_much_it_disaggregated() -> None:
    options = SuiteOptions((Setting(2048, 64),), requests_per_worker=30, precision=0.2,
                           families=("colocated", "split", "auto"), steady_probes=False,
                           splits=("3:1", "hybrid"))  # fmt: skip
    cell = run_cell("70b", "code", "loose", options)
    assert list(cell.families["auto"].searched) == [
        "3P:1D (TP 4:4) chunk 2048 batch 64", "hybrid 4 (TP 4) chunk 2048 batch 64",
    ]  # fmt: skip
    assert list(cell.families["split"].searched) == ["3P:1D (TP 4:4) chunk 2048 batch 64"]
    assert cell.families["colocated"].remote_share == 0.0
    assert cell.families["split"].remote_share == 1.0  # `always`: every prompt on P
    assert 0.0 <= cell.families["auto"].remote_share <= 1.0
    assert _split_names("hybrid,1:7", ["8b"]) == ("hybrid", "1:7")


def test_a_setup_may_run_its_prefill_pool_at_another_tp() -> None:
    """`--models 70b-p4d8`: 16 GPUs as two prefill workers at TP 4 and one decode worker at TP
    8; colocated and hybrid workers at the decode TP."""
    setup = MODELS["70b-p4d8"]
    assert [s.name for s in family_splits(setup, "auto")] == ["2P:1D (TP 4:8)", "hybrid 2 (TP 8)"]
    assert [s.name for s in family_splits(setup, "colocated")] == ["colocated 2 (TP 8)"]
    [split] = family_splits(setup, "split")
    deployment, pools = search_deployments(setup, Setting(2048, 64))
    assert deployment.tp == 8 and pools is not None
    assert (pools(split).prefill_pool.tp, pools(split).tp) == (4, 8)
    assert search_deployments(MODELS["70b"], Setting(2048, 64))[1] is None
    options = SuiteOptions((Setting(2048, 64),), requests_per_worker=30, precision=0.2,
                           families=("split",), steady_probes=False)  # fmt: skip
    cell = run_cell("70b-p4d8", "code", "loose", options)
    assert cell.families["split"].split == "2P:1D (TP 4:8)" and cell.goodput("split") > 0
    assert _split_names("2:1", ["70b-p4d8"]) == ("2:1",)
    with pytest.raises(ValueError, match=r"not a split of 70b-p4d8 \(2:1\)"):
        _split_names("1:1", ["70b-p4d8"])
