"""`pdserve bench soak` for a few seconds against a real local system: the report's shape."""

from __future__ import annotations

import argparse
import json

from pdserve.bench.serving import soak_bench


def test_short_soak_reports_rss_per_process_cancels_and_leftovers(ray_cluster, tmp_path, capsys):
    out = tmp_path / "soak.json"
    parser = argparse.ArgumentParser()
    soak_bench.add_arguments(parser)
    argv = ["--minutes", "0.06", "--rate", "6", "--cancel-fraction", "0.5", "--seed", "3"]
    argv += ["--sample-interval-s", "1", "--mixed-long-input-len", "64"]
    argv += ["--mixed-short-output-len", "12", "--json", str(out)]
    assert soak_bench.run(parser.parse_args(argv)) == 0

    printed = capsys.readouterr().out
    assert "RSS per process" in printed and "max/min" in printed
    assert "cancels issued" in printed and "open transfers 0" in printed
    report = json.loads(out.read_text())
    memory = {m["name"]: m for m in report["memory"]}
    assert set(memory) == {"router", "prefill-0", "decode-0", "redis"}
    for entry in memory.values():
        assert len(entry["samples"]) >= 3, entry  # one a second over 3.6 s, plus the last
        assert all(mib > 0 for _, mib in entry["samples"])
        assert entry["max_over_min"] >= 1.0 and isinstance(entry["flat"], bool)
    assert report["sent"] >= 10  # ~6/s for 3.6 s
    assert report["cancels"] >= 1
    assert (
        report["completed"] + report["cancels"] + sum(report["errors"].values()) == (report["sent"])
    )
    assert (report["open_transfers"], report["used_blocks"], report["clean"]) == (0, 0, True)
    assert set(report["leftovers"]) == {"prefill-0", "decode-0"}
