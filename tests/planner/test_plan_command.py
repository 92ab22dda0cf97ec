"""`pdserve plan`: a small plan end to end, and every mistake as one line naming the flag."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.planner.capacity import worker_rates
from pdserve.planner.deployment import Deployment
from pdserve.planner.splits import tp_splits
from pdserve.planner.workload import load_workload, probe_sample

SLOS = ["--ttft-slo-ms", "400", "--tpot-slo-ms", "40"]


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_small_plan_prints_the_best_splits_and_writes_every_one(
    planner_model_dir, tmp_path, capsys
):
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(f"[{40 + i % 30}, {4 + i % 5}]\n" for i in range(40)))
    out_json = tmp_path / "plan.json"
    code, out, err = _plan(
        capsys,
        "--model", str(planner_model_dir), "--gpus", "2", "--workload", str(workload),
        *SLOS, "--requests-per-worker", "20", "--precision", "0.2", "--top", "2",
        "--json", str(out_json), "--time",
    )  # fmt: skip
    assert code == 0, err
    assert "recommended: " in out and "time: " in out
    plan = json.loads(out_json.read_text())
    assert {s["split"] for s in plan["splits"]} == {"colocated 2", "1P:1D"}
    assert plan["recommended"] in {"colocated 2", "1P:1D"}
    assert plan["compute_ceiling"] > 0 and "compute ceiling: " in out
    best = plan["splits"][0]
    assert best["goodput"] > 0 and best["ttft_ms"]["p90"] <= 400


def test_tp_splits_use_every_gpu_with_each_pool_at_its_tp():
    splits = tp_splits(4, [1, 2], [1, 2])
    assert all(s.gpus == 4 for s in splits)
    assert {s.name for s in splits} == {
        "colocated 4", "colocated 2 (TP 2)",
        "1P:3D", "2P:2D", "3P:1D",
        "2P:1D (TP 1:2)", "1P:1D (TP 2:2)", "1P:2D (TP 2:1)",
    }  # fmt: skip
    assert tp_splits(3, [2], [2]) == []


def test_a_plan_at_one_tp_for_both_pools(planner_model_dir, tmp_path, capsys):
    """--tp 2 alone (the issue's `pdserve plan ... --tp 4`): colocated workers prefill at
    their own TP, so no split asks for a TP-1 deployment the plan never made."""
    assert {(s.prefill_tp, s.decode_tp) for s in tp_splits(4, [2], [2])} == {(2, 2)}
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(f"[{40 + i % 30}, {4 + i % 5}]\n" for i in range(40)))
    out_json = tmp_path / "plan.json"
    code, _, err = _plan(
        capsys,
        "--model", str(planner_model_dir), "--gpus", "4", "--tp", "2",
        "--workload", str(workload), *SLOS, "--requests-per-worker", "20",
        "--precision", "0.3", "--json", str(out_json),
    )  # fmt: skip
    assert code == 0, err
    plan = json.loads(out_json.read_text())
    assert {s["split"] for s in plan["splits"]} == {"colocated 2 (TP 2)", "1P:1D (TP 2:2)"}
    assert all(s["goodput"] > 0 for s in plan["splits"])


def test_each_split_is_kept_at_the_step_budget_it_serves_most_at(
    planner_model_dir, tmp_path, capsys
):
    """--max-num-batched-tokens 256,2048: every split searched at each budget, and the plan is
    each split's best of the single-budget plans, with the budget it was found at. Long prompts
    under a tight TPOT: colocated serves most with small chunks, the split with large ones, so
    one budget for both would misjudge one of them (issue 49 point 0)."""
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(f"[{1200 + i % 600}, {16 + i % 8}]\n" for i in range(160)))

    def plan(budgets: str) -> dict:
        out_json = tmp_path / f"plan-{budgets}.json"
        code, out, err = _plan(
            capsys,
            "--model", str(planner_model_dir), "--gpus", "2", "--workload", str(workload),
            "--ttft-slo-ms", "1000", "--tpot-slo-ms", "10", "--requests-per-worker", "80",
            "--precision", "0.2", "--max-num-batched-tokens", budgets, "--json", str(out_json),
        )  # fmt: skip
        assert code == 0, err
        return json.loads(out_json.read_text()) | {"printed": out}

    small, large, both = plan("256"), plan("2048"), plan("256,2048")
    assert "step tokens" in both["printed"] and "step tokens" not in small["printed"]
    assert both["max_num_batched_tokens"] == [256, 2048]
    assert {s["max_num_batched_tokens"] for s in small["splits"]} == {None}
    singles = {256: small, 2048: large}
    for split in both["splits"]:
        at = {
            b: next(s for s in p["splits"] if s["split"] == split["split"])
            for b, p in singles.items()
        }
        assert split["goodput"] == max(s["goodput"] for s in at.values())
        assert split["goodput"] == at[split["max_num_batched_tokens"]]["goodput"]
    budget = {s["split"]: s["max_num_batched_tokens"] for s in both["splits"]}
    assert budget == {"colocated 2": 256, "1P:1D": 2048}
    assert both["recommended"] == "colocated 2" and large["recommended"] == "1P:1D"


def test_a_tp_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "m", "--gpus", "2", "--workload", "chat", *SLOS,
              "--prefill-tp", "1,0"])  # fmt: skip
    assert "argument --prefill-tp: must be at least 1, got 0" in capsys.readouterr().err


def test_a_plan_searches_tp_per_pool(planner_model_dir, tmp_path, capsys):
    """--prefill-tp / --decode-tp: each pool's workers at each of its TPs; every split uses
    the GPUs."""
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(f"[{40 + i % 30}, {4 + i % 5}]\n" for i in range(40)))
    out_json = tmp_path / "plan.json"
    code, out, err = _plan(
        capsys,
        "--model", str(planner_model_dir), "--gpus", "4", "--workload", str(workload),
        *SLOS, "--requests-per-worker", "20", "--precision", "0.3", "--top", "3",
        "--prefill-tp", "1,2", "--decode-tp", "2", "--json", str(out_json),
    )  # fmt: skip
    assert code == 0, err
    plan = json.loads(out_json.read_text())
    splits = {s["split"]: s for s in plan["splits"]}
    assert set(splits) == {"colocated 2 (TP 2)", "2P:1D (TP 1:2)", "1P:1D (TP 2:2)"}
    for s in plan["splits"]:
        assert s["prefill_workers"] * s["prefill_tp"] + s["decode_workers"] * s["decode_tp"] == 4
    assert plan["tp"] == "prefill 1,2, decode 2"
    assert "recommended: " in out
    assert all(s["estimate"] > 0 for s in plan["splits"])


def test_each_pool_is_timed_at_its_own_tp(planner_model_dir):
    """A prefill pool at TP 2 beside a decode pool at TP 1: prefill workers get the tp2
    profile (a faster prefill per worker), decode and colocated workers keep tp1's."""
    sample = probe_sample(load_workload("chat", 50, 0), 50, 0)
    tp1, tp2 = (Deployment(str(planner_model_dir), tp=tp) for tp in (1, 2))
    mixed = tp1.with_prefill_pool(tp2)
    assert mixed.for_role("prefill").profile == "analytical:h100:tp2"
    assert mixed.for_role("decode").profile == "analytical:h100:tp1"
    plain, split = worker_rates(tp1, sample), worker_rates(mixed, sample)
    assert split.prefill > 1.3 * plain.prefill
    assert split.decode == plain.decode


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "3", "--decode-tp", "2", "--prefill-tp", "2"], "--gpus 3 holds no worker"),
        (
            ["--decode-tp", "1,2", "--profile", "analytical:h100"],
            "--profile times every worker alike",
        ),
        (["--gpu", "b200"], "--gpu: unknown GPU 'b200' (known: a100, h100, h200, l40s)"),
        (["--gpus", "3", "--tp", "2"], "--gpus 3 is not a multiple of --tp 2"),
        (
            ["--workload", "nope"],
            "--workload 'nope': neither a preset (chat, rag, mixed) nor a file",
        ),
        (
            ["--model", "llama-9b"],
            "--model 'llama-9b': neither a model directory nor a known shape",
        ),
        (["--profile", "analytical:b200"], "--profile: analytical:b200: unknown GPU 'b200'"),
    ],
)
def test_mistakes_are_one_line_errors_naming_the_flag(planner_model_dir, capsys, args, message):
    base = {"--model": str(planner_model_dir), "--gpus": "4", "--workload": "chat"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    code, _, err = _plan(capsys, *[x for kv in base.items() for x in kv], *SLOS)
    assert code == 2
    assert err.count("\n") == 1 and message in err, err


def test_a_bad_workload_line_names_the_file_and_line(planner_model_dir, tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text('[100, 10]\n{"prompt_len": 5, "output_len": 0}\n')
    code, _, err = _plan(
        capsys, "--model", str(planner_model_dir), "--gpus", "2", "--workload", str(workload),
        *SLOS,
    )  # fmt: skip
    assert code == 2
    assert err.count("\n") == 1
    assert f"{workload}:2: output_len must be an integer >= 1, got 0" in err


def test_a_request_longer_than_the_context_is_refused(planner_model_dir, tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text("[9000, 10]\n")  # the model's context is 8192 tokens
    code, _, err = _plan(
        capsys, "--model", str(planner_model_dir), "--gpus", "2", "--workload", str(workload),
        *SLOS,
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "1 requests exceed the context of 8192 tokens" in err


def test_a_slo_must_be_positive(planner_model_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", str(planner_model_dir), "--gpus", "2", "--workload", "chat",
              "--ttft-slo-ms", "0", "--tpot-slo-ms", "40"])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ttft-slo-ms" in err


@pytest.mark.parametrize("policy", ["approximate", "random", "prefix"])
def test_a_plan_can_route_by_every_routing_policy(policy):
    from pdserve.cli import build_parser

    argv = ["plan", "--model", "m", "--gpus", "2", "--workload", "w", *SLOS, "--policy", policy]
    assert build_parser(argv).parse_args(argv).policy == policy
