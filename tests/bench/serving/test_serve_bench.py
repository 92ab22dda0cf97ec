"""`pdserve bench serve` end to end against the echo gRPC server: table, JSON, plots, errors."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.serving import serve_bench
from tests.bench.echo_server import EchoServer, EchoServicer


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    return serve_bench.run(parser.parse_args(argv))


@pytest.fixture
def server():
    with EchoServer(EchoServicer(token_delay_s=0.001, tokens_per_chunk=2)) as echo:
        yield echo


def test_mixed_workload_report_json_and_plots(server, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--target", server.target, "--dataset", "mixed", "--num-requests", "20"]
    argv += ["--request-rate", "500", "--burstiness", "0.5", "--seed", "7"]
    argv += ["--mixed-long-fraction", "0.25", "--mixed-long-input-len", "40"]
    argv += ["--mixed-long-output-len", "2", "--mixed-short-input-len", "4"]
    argv += ["--mixed-short-output-len", "8", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "1000"]
    assert _run([*argv, "--json", str(out), "--plot", str(tmp_path / "plots")]) == 0

    table = capsys.readouterr().out
    assert "Serving benchmark" in table and "goodput" in table and "By request class" in table
    document = json.loads(out.read_text())
    summary = document["summary"]
    assert (summary["completed"], summary["failed"]) == (20, 0)
    assert summary["total_output_tokens"] == 5 * 2 + 15 * 8
    assert summary["good_requests"] == 20
    assert set(summary["ttft"]) >= {"mean", "p50", "p90", "p99"}
    assert sorted(document["by_tag"]) == ["long", "short"]
    assert len(document["requests"]) == 20
    assert document["requests"][0]["chunk_times"]
    assert document["config"]["dataset"] == "mixed"
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "e2e_cdf.png",
        "itl_cdf.png",
        "tpot_cdf.png",
        "ttft_cdf.png",
    ]
    # The workload was sent as token ids, exact lengths, never the EOS id (0).
    prompts = [list(r.token_ids.ids) for r in server.servicer.requests]
    assert sorted(len(p) for p in prompts) == [4] * 15 + [40] * 5
    assert all(0 not in p for p in prompts)


def test_closed_loop_shared_prefix_and_sharegpt(server, tmp_path):
    argv = ["--target", server.target, "--no-progress", "--max-concurrency", "4"]
    gsp = ["--dataset", "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3"]
    gsp += ["--gsp-system-prompt-len", "16", "--gsp-question-len", "4", "--gsp-output-len", "3"]
    assert _run([*argv, *gsp]) == 0
    assert len(server.servicer.requests) == 6

    sharegpt = tmp_path / "sg.json"
    turns = [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "f g h i j k"}]
    sharegpt.write_text(json.dumps([{"conversations": turns}]))
    assert _run([*argv, "--dataset", f"sharegpt:{sharegpt}", "--num-requests", "1"]) == 0
    last = server.servicer.requests[-1]
    assert last.text == "a b c d e" and last.sampling.max_tokens == 6  # Tokenize RPC counted


def test_failures_and_bad_arguments_are_reported(server, capsys):
    assert _run(["--target", server.target, "--request-rate", "0"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err
    assert _run(["--target", server.target, "--dataset", "bogus"]) == 2
    assert _run(["--target", "127.0.0.1:1", "--timeout", "5"]) == 1
    assert "error: UNAVAILABLE" in capsys.readouterr().err
    server.servicer.api_key = "needed"
    argv = ["--target", server.target, "--num-requests", "3", "--random-input-len", "4"]
    assert _run([*argv, "--no-progress"]) == 1  # every request failed
    captured = capsys.readouterr()
    assert "  UNAUTHENTICATED " in captured.out and " 0 / 3 " in captured.out
    assert "first failure: UNAUTHENTICATED" in captured.err
