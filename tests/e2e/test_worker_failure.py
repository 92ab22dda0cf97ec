"""A decode pool that cannot serve says why: the client's UNAVAILABLE status, `/ready` and gRPC
health name the worker and its failure, not just "no healthy decode worker"."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import GenerationClient, GenerationError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served_app(ray_cluster):
    from pdserve.app import BackgroundApp
    from tests.e2e.conftest import serve_config

    with BackgroundApp(serve_config("grpc", prefill_workers=0, decode_workers=1)) as app:
        yield app


def test_a_dead_decode_worker_is_named_to_clients_and_probes(served_app, ray_cluster):
    ready_url = f"http://127.0.0.1:{served_app.http_port}/ready"
    target = f"127.0.0.1:{served_app.port}"
    assert httpx.get(ready_url).status_code == 200
    decode = served_app.app.pool.workers["decode-0"]
    ray_cluster.kill(decode.actor, no_restart=True)
    deadline = time.monotonic() + 30
    while (response := httpx.get(ready_url)).status_code == 200:
        assert time.monotonic() < deadline, "/ready still 200 with the decode worker dead"
        time.sleep(0.2)
    assert response.status_code == 503
    reason = response.json()["error"]["message"]
    assert reason.startswith("no healthy decode worker (decode-0: ")
    assert "ActorDiedError" in reason, reason
    with grpc.insecure_channel(target) as channel:
        check = health_pb2.HealthCheckRequest(service="pdserve.v1.Generation")
        status = health_pb2_grpc.HealthStub(channel).Check(check).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    with GenerationClient(target) as client, pytest.raises(GenerationError) as refused:
        client.generate("Hello", max_tokens=2)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert "decode-0: " in refused.value.details and "ActorDiedError" in refused.value.details
