"""`pdserve bench spec` at tiny size: every (workload, batch) gets a plain, an ngram and a draft
row with its acceptance, cost ratio and the Leviathan limit; the limit's arithmetic; the
repeating workload's prompts do repeat."""

from __future__ import annotations

import re

import pytest

from pdserve.bench.decoding.spec_bench import expected_tokens, fit_alpha, leviathan_limit
from pdserve.bench.decoding.spec_workloads import repeating_prompts
from pdserve.cli import main
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import builtin_model_dir

ROW = re.compile(
    r"^\s*(repeating|novel)\s+(\d+)\s+(ngram|draft)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)\s+"
    r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
    re.MULTILINE,
)


def test_bench_prints_every_mode_of_every_cell(capsys):
    argv = ["bench", "spec", "--preset", "tiny", "--batch-sizes", "2", "--steps", "4"]
    assert main([*argv, "--repeats", "1", "--warmup-tokens", "16"]) == 0
    out = capsys.readouterr().out
    rows = ROW.findall(out)
    cells = [(w, int(b), m) for w, b, m, *_ in rows]
    assert cells == [(w, 2, m) for w in ("repeating", "novel") for m in ("ngram", "draft")]
    plain = re.findall(r"^\s*(repeating|novel)\s+2\s+off\s+([\d.]+)\s+1\.00x$", out, re.M)
    assert len(plain) == 2
    for *_, rate, speedup, accept, alpha, c, limit, ratio, alpha_all, limit_all, ratio_all in rows:
        assert float(rate) > 0 and 0 <= float(accept) <= 1 and 0 <= float(alpha) <= 1
        # The limit (acceptance over drafted tokens), and the same over every step.
        for a, lim, r in ((alpha, limit, ratio), (alpha_all, limit_all, ratio_all)):
            assert 0 <= float(a) <= 1
            assert float(lim) == pytest.approx(
                leviathan_limit(float(a), 4, float(c)), rel=0.05, abs=0.01
            )
            assert float(r) == pytest.approx(float(speedup) / float(lim), rel=0.05, abs=0.01)


def test_prompt_kv_report_has_a_row_per_length(capsys):
    argv = ["bench", "spec", "--preset", "tiny", "--prompt-kv", "8,40", "--repeats", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "draft prompt KV (1 layers, 256 bytes/token) at 0.52 GB/s" in out
    rows = re.findall(
        r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", out, re.M
    )
    assert [int(r[0]) for r in rows] == [8, 40]


def test_limit_and_alpha():
    assert leviathan_limit(0.0, 4, 0.0) == 1.0
    assert leviathan_limit(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert leviathan_limit(0.5, 2, 0.0) == pytest.approx(1.75)
    for alpha in (0.0, 0.3, 0.6, 0.9):
        assert fit_alpha(expected_tokens(alpha, 4), 4) == pytest.approx(alpha, abs=1e-6)
    assert fit_alpha(5.0, 4) == 1.0


def test_repeating_prompts_repeat_their_context():
    engine = LLMEngine(EngineConfig(model=str(builtin_model_dir("tiny")), num_kv_blocks=256))
    prompts, hit_rate = repeating_prompts(engine, 4, 8, 32)
    assert len(prompts) == 4 and all(len(p) == 8 + 32 for p in prompts)
    assert hit_rate >= 0.6


def test_cuda_refuses_the_cpu_clock_and_cpu_defaults_to_it(capsys):
    # The process's CPU seconds count none of a GPU's work: refused before anything is built.
    with pytest.raises(SystemExit, match="--clock cpu measures nothing"):
        main(["bench", "spec", "--device", "cuda", "--clock", "cpu"])
    argv = ["bench", "spec", "--preset", "tiny", "--batch-sizes", "1", "--steps", "4"]
    assert main([*argv, "--repeats", "1", "--workloads", "novel", "--device", "cpu"]) == 0
    assert "cpu float32, cpu clock" in capsys.readouterr().out


def test_a_residual_scale_writes_a_target_its_draft_agrees_with(capsys):
    argv = ["bench", "spec", "--preset", "tiny", "-k", "1", "--batch-sizes", "1", "--steps", "16"]
    argv += ["--workloads", "novel", "--repeats", "1"]
    accepts = {}
    for scale in ("1", "0.1"):
        assert main([*argv, "--residual-scale", scale]) == 0
        rows = ROW.findall(capsys.readouterr().out)
        accepts[scale] = {mode: float(accept) for _, _, mode, _, _, accept, *_ in rows}
    # The 1-layer draft of tiny (2 layers): 0.34 accepted at scale 1, 0.92 at 0.1 (engine).
    assert accepts["0.1"]["draft"] > 0.6 > accepts["1"]["draft"], accepts


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--residual-scale", "0"], "must be in (0, 1]"),
        (["--residual-scale", "2"], "must be in (0, 1]"),
        (["--residual-scale", "0.5", "--model", "somewhere"], "drop --model"),
    ],
)
def test_bad_residual_scales_are_refused(extra, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["bench", "spec", "--preset", "tiny", *extra])
