"""`pdserve bench tp-handoff` at its smallest: every pair hands off exactly on both transports,
each prefill rank reads out its share of the KV, and the ratios are of the printed seconds'
baseline; a bad pair is refused naming the flag."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.cli import main

SMALLEST = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--block-size", "4"]


def test_bench_hands_off_each_pair_exactly_on_each_transport(tmp_path, capsys):
    out_json = tmp_path / "tp-handoff.json"
    flags = ["--tokens", "16", "--transports", "collective", "--pairs", "1>1,1>2,2>1"]
    assert main(["bench", "tp-handoff", *SMALLEST, *flags, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "KV 4,096 B (float32); median of 3; vs grpc" in out
    rows = re.findall(
        r"^(\d)->(\d) +(\w+) +([\d,]+)(?: x (\d))? +\d+ +[\d.]+ +([\d.]+)x (\w+)$", out, re.M
    )
    assert {(p, d, t) for p, d, t, *_ in rows} == {
        (p, d, t) for p, d in [("1", "1"), ("1", "2"), ("2", "1")] for t in ("grpc", "collective")
    }
    for prefill_tp, _, transport, per_rank, ranks, ratio, exact in rows:
        assert exact == "True"
        assert int(per_rank.replace(",", "")) * int(ranks or 1) == 4096  # each its share
        assert int(ranks or 1) == int(prefill_tp)
        if transport == "grpc":
            assert ratio == "1.00"
    written = json.loads(out_json.read_text())
    assert written["baseline"] == "grpc" and len(written["handoffs"]) == 6
    for handoff in written["handoffs"]:
        assert sum(handoff["rank_bytes"]) == 4096 and handoff["median_s"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pairs", "1-2"], "--pairs: '1-2' is not P>D pairs"),
        (["--pairs", "1>4"], "--pairs: a TP size above --kv-heads"),
        (["--transports", "tcp"], "--transports: unknown transport 'tcp'"),
        (["--tokens", "2"], "--tokens: at least one block"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(flags, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["bench", "tp-handoff", *SMALLEST, "--transports", "grpc", *flags])
