"""`pdserve bench moe-tp`: an MoE model on 2 spawned ranks, its experts all-reduced and
dispatched with all_to_all, measured in one run."""

from __future__ import annotations

import re

import pytest

from pdserve.cli import main
from tests.models.test_llama_matches_transformers import make_hf_model

pytest.importorskip("transformers")


def test_bench_prints_both_ways_and_their_ratio(tmp_path, capsys):
    make_hf_model(tmp_path, "qwen3-moe-top2")
    argv = ["bench", "moe-tp", "--model", str(tmp_path), "--batch", "3", "--prompt-len", "5"]
    assert main([*argv, "--steps", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "at TP 2, 1 thread(s) a rank, batch 3, prompts of 5, 3 new tokens" in out
    rows = {
        mode: (float(prefill), float(decode))
        for mode, prefill, decode in re.findall(
            r"^(all-reduce|all_to_all) +([\d.]+) +([\d.]+)$", out, re.M
        )
    }
    assert set(rows) == {"all-reduce", "all_to_all"} and all(min(r) > 0 for r in rows.values())
    ratios = re.search(r"prefill ([\d.]+)x, decode ([\d.]+)x", out).groups()
    for i, ratio in enumerate(ratios):  # of the printed tok/s, to their rounding
        expected = rows["all_to_all"][i] / rows["all-reduce"][i]
        assert float(ratio) == pytest.approx(expected, abs=0.01)


def test_a_single_rank_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--tp must be at least 2"):
        main(["bench", "moe-tp", "--tp", "1"])
