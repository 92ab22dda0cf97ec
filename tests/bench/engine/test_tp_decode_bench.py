"""`pdserve bench tp-decode`: the tiny model at TP 2 (2 spawned ranks) and TP 1, measured in
one run: every figure printed, the ratios of the printed tok/s, each rank's handoff bytes half
the whole KV (tiny has 2 KV heads); a single rank is refused naming the flag."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.cli import main


def test_bench_prints_tp_against_tp1_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "tp-decode.json"
    argv = ["bench", "tp-decode", "--preset", "tiny", "--batch", "2", "--prompt-len", "32"]
    assert main([*argv, "--tokens", "4", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    tp1 = {
        int(n): float(v) for n, v in re.findall(r"^TP 1, (\d) thread\(s\): ([\d.]+)$", out, re.M)
    }
    assert set(tp1) == {1, 2} and min(tp1.values()) > 0
    tp2 = float(re.search(r"^TP 2 \(2 ranks x 1 thread\): ([\d.]+);", out, re.M).group(1))
    assert tp2 > 0 and re.search(r"broadcast [\d.]+ ms per command \(\d+ commands\)", out)
    ratios = re.search(r"TP 2 / TP 1: ([\d.]+)x \(1 thread\(s\)\), ([\d.]+)x \(2", out).groups()
    for n, ratio in zip((1, 2), ratios, strict=True):  # of the printed tok/s, to their rounding
        assert float(ratio) == pytest.approx(tp2 / tp1[n], rel=0.01, abs=0.01)
    whole, own = (
        int(b) for b in re.search(r"whole KV (\d+) bytes, one rank's heads (\d+)", out).groups()
    )
    assert own * 2 == whole > 0
    written = json.loads(out_json.read_text())
    assert written["handoff_bytes"] == whole and written["rank_handoff_bytes"] == own
    assert written["tp2_over_tp1_1_threads"] == pytest.approx(tp2 / tp1[1], rel=0.01)


def test_a_single_rank_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--tp must be at least 2"):
        main(["bench", "tp-decode", "--tp", "1"])
