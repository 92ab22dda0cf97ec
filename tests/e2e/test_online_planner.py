"""`pdserve serve --plan-interval S`: a live system plans the split for the traffic it served,
from its router's measured costs — in the log, as Prometheus gauges and in Redis for
`pdserve stats`."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from prometheus_client import REGISTRY

from pdserve.pb import generate_pb2_grpc
from pdserve.prefix_index.schema import IndexKeys
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import VOCAB_LOW, collect, request


@pytest.fixture(scope="module")
def served(ray_cluster):
    from pdserve.app import BackgroundApp

    config = serve_config("grpc", prefill_workers=1, decode_workers=1)
    config.router.plan_interval_s = 2.0
    with BackgroundApp(config) as app:
        yield app


def test_the_served_traffic_is_planned_and_exported(served, caplog):
    caplog.set_level(logging.INFO, logger="router.online_plan")
    prompts = [[VOCAB_LOW + (i * 7 + j) % 300 for j in range(8 + i % 24)] for i in range(30)]
    planner = served.app.planner
    deadline = time.monotonic() + 240

    def next_plan(previous: dict | None) -> dict | None:
        """The first plan made after `previous` (its error too), or the latest in 60 s."""
        until = min(deadline, time.monotonic() + 60)
        while planner.latest is previous and time.monotonic() < until:
            time.sleep(0.2)
        return planner.latest

    # Rounds of traffic until one is planned: a plan needs 20 requests in one 2 s window, and
    # a round's requests can straddle two windows (17 in one, once, on a loaded CI host).
    latest = None
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        with ThreadPoolExecutor(max_workers=4) as pool:
            while time.monotonic() < deadline:
                before = planner.latest
                outputs = list(pool.map(lambda p: collect(stub, request(p, 6))[0], prompts))
                assert all(len(tokens) == 6 for tokens in outputs)
                latest = next_plan(before)
                if latest is not None and "recommended" in latest:
                    break
    assert latest is not None and "error" not in latest, latest
    assert latest["workers"] == 2
    assert latest["recommended"] in {"colocated 2", "1P:1D"}
    assert latest["window_requests"] >= 20
    assert latest["observed_rps"] > 0 and latest["goodput_rps"] > 0
    assert any("online planner: " in r.getMessage() for r in caplog.records)

    for role in ("prefill", "decode"):
        exported = REGISTRY.get_sample_value("pdserve_planner_workers", {"role": role})
        assert exported is not None

    client = redis.Redis.from_url(served.app.redis_server.url)
    keys = IndexKeys(Path(planner.settings.model_dir).name)
    text = client.get(keys.plan)  # written off the router's event loop, just after `latest`
    while text is None and time.monotonic() < deadline:
        time.sleep(0.1)
        text = client.get(keys.plan)
    stored = json.loads(text)
    assert stored["recommended"] in {"colocated 2", "1P:1D"}
