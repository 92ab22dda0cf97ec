"""`pdserve bench serve` and `pdserve bench api --together` against the served system
(tests/openai/sdk/conftest.py): either API, or both at once, driven to the end."""

from __future__ import annotations

import pytest

from tests.openai.served import KEY, LOW


@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_bench_serve_drives_either_api_with_the_same_workload(served, backend, tmp_path):
    import argparse
    import json

    from pdserve.bench.serving import serve_bench

    out = tmp_path / "run.json"
    argv = ["--backend", backend, "--api-key", KEY, "--no-progress", "--json", str(out)]
    argv += ["--dataset", "random", "--num-requests", "6", "--max-concurrency", "3"]
    argv += ["--random-input-len", "16", "--random-output-len", "8", "--seed", "3"]
    if backend == "openai":
        argv += ["--base-url", f"http://127.0.0.1:{served.http_port}/v1"]  # vocabulary: the card's
    else:
        argv += ["--target", f"127.0.0.1:{served.port}"]
    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    assert serve_bench.run(parser.parse_args(argv)) == 0
    document = json.loads(out.read_text())
    assert (document["summary"]["completed"], document["summary"]["failed"]) == (6, 0)
    assert document["summary"]["total_output_tokens"] == 6 * 8
    assert all(len(r["chunk_times"]) >= 1 for r in document["requests"])
    assert document["config"]["model"] == served.model_dir.name


def test_the_api_bench_drives_both_apis_at_once_to_the_end(served, model):
    """`pdserve bench api --together`: both clients on one event loop, each its own requests
    and arrival schedule, overlapping in time, every token of every stream received."""
    from pdserve.bench.serving.api_bench import APIS, run_clients_together
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    dataset = DatasetConfig(name="random", random_input_len=24, random_output_len=6)
    requests = generate_requests(dataset, 8, 3, 260, avoid_token_ids=range(LOW))
    addresses = {
        "grpc": f"127.0.0.1:{served.port}",
        "http": f"http://127.0.0.1:{served.http_port}/v1",
    }
    loads = {
        api: {"max_concurrency": 2, "seed": seed, "request_rate": 40.0, "api_key": KEY}
        for seed, api in enumerate(APIS)
    }
    got = run_clients_together(
        addresses, model, {"grpc": requests[:4], "http": requests[4:]}, loads
    )
    assert sorted(got) == sorted(APIS)
    for records in got.values():
        assert [r.ok for r in records] == [True] * 4, [r.error for r in records]
        assert [r.output_tokens for r in records] == [6] * 4
    spans = {
        api: (min(r.send_time for r in rs), max(r.end_time for r in rs)) for api, rs in got.items()
    }
    (grpc_start, grpc_end), (http_start, http_end) = spans["grpc"], spans["http"]
    assert grpc_start < http_end and http_start < grpc_end  # the two loads overlapped
