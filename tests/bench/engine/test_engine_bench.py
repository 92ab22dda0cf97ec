"""`pdserve bench engine` runs both engines on the same weights and prints one ratio per batch."""

from __future__ import annotations

import re

import pytest

from pdserve.cli import main

# batch, pdserve tok/s, the baseline's tok/s, their ratio, the median of the runs' ratios
ROW = r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)x$"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_bench_prints_both_rates_and_their_ratio(dtype, capsys):
    argv = ["bench", "engine", "--preset", "tiny", "--batch-sizes", "1,3", "--steps", "3"]
    assert main([*argv, "--repeats", "1", "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert f"greedy, {dtype}" in out
    rows = re.findall(ROW, out, re.MULTILINE)
    assert [int(batch) for batch, *_ in rows] == [1, 3]
    for _, ours, theirs, ratio, median in rows:
        # Rates print with one decimal and the ratio with two, from the unrounded rates.
        assert float(ratio) == pytest.approx(float(ours) / float(theirs), rel=0.02, abs=0.006)
        assert median == ratio  # one run each: its ratio is the median


@pytest.mark.parametrize("decoding", ["beam4", "n4", "json"])
def test_engine_bench_measures_a_decoding_rule_in_both_engines(decoding, capsys):
    argv = ["bench", "engine", "--preset", "tiny", "--batch-sizes", "2", "--steps", "3"]
    assert main([*argv, "--repeats", "1", "--decoding", decoding]) == 0
    out = capsys.readouterr().out
    assert f"{decoding}, float32" in out
    rows = re.findall(ROW, out, re.MULTILINE)
    assert [int(batch) for batch, *_ in rows] == [2]
    assert all(float(ours) > 0 and float(theirs) > 0 for _, ours, theirs, *_ in rows)


def test_op_profile_splits_decode_steps_into_matmuls_and_the_rest(capsys):
    argv = ["bench", "engine", "--preset", "tiny", "--batch-sizes", "1,4", "--steps", "4"]
    assert main([*argv, "--repeats", "1", "--op-profile"]) == 0
    out = capsys.readouterr().out
    assert "decode steps at batch 4" in out
    # The weight matmuls: oneDNN's over reordered weights where this torch has it (batch 4).
    assert re.search(r"^(aten::mm|mkldnn::_linear_pointwise)\s+([\d.]+)\s", out, re.MULTILINE)
    matmuls, rest = re.search(r"weight matmuls ([\d.]+)%, everything else ([\d.]+)%", out).groups()
    assert float(matmuls) > 0 and float(matmuls) + float(rest) == pytest.approx(100, abs=0.11)


def test_step_phases_time_decode_steps_by_the_engines_phases(capsys):
    argv = ["bench", "engine", "--preset", "tiny", "--batch-sizes", "1,4", "--steps", "6"]
    assert main([*argv, "--repeats", "1", "--step-phases"]) == 0
    out = capsys.readouterr().out.split("by phase:")[1]
    rows = dict(re.findall(r"^(\w[\w ()]+?)\s+([\d.]+)\s+[\d.]+%$", out, re.MULTILINE))
    # On CPU the model runs on the host: no GPU wait.
    assert set(rows) == {"scheduling", "model (host)", "sampling", "outputs", "other"}
    assert float(rows["model (host)"]) > 0 and float(rows["sampling"]) > 0
    assert re.search(r"step [\d.]+ ms wall \(medians of \d+ decode steps\)", out)
    # Every weight matmul, whichever path, is timed inside the model's phase.
    matmuls = float(re.search(r"^  weight matmuls\s+([\d.]+)\s", out, re.MULTILINE).group(1))
    assert 0 < matmuls < float(rows["model (host)"])
    assert re.search(r"outside the weight matmuls: [\d.]+% of a step \(median\)", out)


def test_step_phases_put_the_engines_calls_back():
    from pdserve.bench.engine.step_phases import WEIGHT_MATMULS, StepPhases
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig
    from pdserve.models import linear_kernels
    from pdserve.models.builtin import builtin_model_dir

    engine = LLMEngine(EngineConfig(model=str(builtin_model_dir("tiny"))), emit_text=False)
    executor = engine.executor
    gemm = linear_kernels.gemm
    sampler = executor.sampler
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    phases = StepPhases(engine, "cpu")
    while engine.has_unfinished():
        phases.record(engine.step)
    phases.close()
    step = phases.steps[-1]
    outer = {k: v for k, v in step.items() if k not in ("wall", WEIGHT_MATMULS)}
    assert sum(outer.values()) == pytest.approx(step["wall"])
    assert executor.sampler is sampler
    assert linear_kernels.gemm is gemm
    for owner, name in [
        (engine.scheduler, "schedule"),
        (executor.runner, "run"),
        (engine.step_outputs, "postprocess"),
    ]:
        assert name not in vars(owner)


def test_several_prompt_lengths_print_a_table_each_from_the_same_engines(capsys):
    argv = ["bench", "engine", "--preset", "tiny", "--batch-sizes", "2", "--steps", "3"]
    assert main([*argv, "--repeats", "1", "--decoding", "beam4", "--prompt-len", "8,40"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"prompt (\d+) tokens", out) == ["8", "40"]
    rows = re.findall(ROW, out, re.MULTILINE)
    assert [int(batch) for batch, *_ in rows] == [2, 2]
