"""The helpers the paired benchmarks (`bench api`, `bench tracing`) share: flags, workload,
system, ratio table and exit status."""

from __future__ import annotations

import argparse
import json

import pytest
from rich.console import Console

from pdserve.bench.common.local_system import (
    add_paired_arguments,
    finish_paired,
    paired_workload,
    ratio_table,
    serve_pair,
)
from pdserve.workloads.metrics import RequestRecord, summarize


def _args(tmp_path, *argv: str) -> argparse.Namespace:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "eos_token_id": 2}))
    parser = argparse.ArgumentParser()
    add_paired_arguments(parser, "mode", rounds=3, rounds_help="pairs")
    return parser.parse_args(["--model", str(tmp_path), *argv])


def test_paired_workload_makes_the_random_requests_the_flags_ask_for(tmp_path):
    args = _args(tmp_path, "--num-requests", "5", "--input-len", "7", "--output-len", "3")
    model_dir, requests = paired_workload(args)
    assert model_dir == tmp_path and args.rounds == 3
    assert len(requests) == 5
    assert all(r.prompt_len == 7 and r.output_len == 3 for r in requests)


def test_paired_workload_draws_lengths_around_the_flags_with_a_range_ratio(tmp_path):
    args = _args(
        tmp_path, "--num-requests", "40", "--output-len", "32", "--random-range-ratio", "0.5"
    )
    _, requests = paired_workload(args)
    outputs = {r.output_len for r in requests}
    assert len(outputs) > 5 and all(16 <= n <= 48 for n in outputs)
    assert all(64 <= r.prompt_len <= 192 for r in requests)


@pytest.mark.parametrize("flag", ["--num-requests", "--max-concurrency", "--rounds"])
def test_paired_workload_refuses_counts_below_one(tmp_path, flag):
    with pytest.raises(SystemExit, match="must be >= 1"):
        paired_workload(_args(tmp_path, flag, "0"))


def test_ratio_table_names_the_ratio_and_divides_second_by_first():
    table = ratio_table("t", ("off", "on"), [("p50 TTFT ms", 2.0, 3.0), ("zero", 0.0, 1.0)])
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "on/off" in text and "1.500" in text and "-" in text


def _record(ok: bool) -> RequestRecord:
    return RequestRecord(0, "r", 4, 2, send_time=0.0, chunk_times=[0.1], chunk_tokens=[1], ok=ok)


def test_finish_paired_writes_json_and_fails_when_any_request_failed(tmp_path):
    out = tmp_path / "out.json"
    good = {"a": summarize([_record(True)], 1.0), "b": summarize([_record(True)], 1.0)}
    assert finish_paired(good, str(out)) == 0
    assert set(json.loads(out.read_text())) == {"a", "b"}
    bad = {"a": summarize([_record(True)], 1.0), "b": summarize([_record(False)], 1.0)}
    assert finish_paired(bad, None) == 1


def test_serve_pair_is_one_prefill_and_one_decode_worker_prefilling_remotely(tmp_path):
    background = serve_pair(tmp_path)  # configured, not started
    try:
        config = background.app.config
        assert (config.prefill_workers, config.decode_workers) == (1, 1)
        assert config.router.disaggregate == "always"
        assert config.engine.model == str(tmp_path)
    finally:
        background.loop.close()
