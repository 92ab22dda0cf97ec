"""The router's API as clients and operators meet it: health, reflection, the Python client."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.client import AsyncGenerationClient, GenerationClient, GenerationError
from tests.e2e.test_disaggregated_serving import VOCAB_LOW, reference_outputs


@pytest.fixture(scope="module")
def served_app(ray_cluster):
    from pdserve.app import BackgroundApp
    from tests.e2e.conftest import serve_config

    config = serve_config(
        "grpc", prefill_workers=1, decode_workers=2, metrics_port=0, metrics_host="127.0.0.1"
    )
    with BackgroundApp(config) as app:
        yield app


@pytest.fixture(scope="module")
def target(served_app):
    return f"127.0.0.1:{served_app.port}"


def test_health_reports_liveness_and_readiness(target):
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.Generation"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service


def test_reflection_lists_the_generation_service(target):
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(stub.ServerReflectionInfo(iter([request])))
        names = {s.name for s in response.list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_python_client_streams_the_exact_greedy_output(target):
    prompt = list(range(VOCAB_LOW + 7, VOCAB_LOW + 40))
    expected = reference_outputs([prompt], [10])[0]
    with GenerationClient(target) as client:
        chunks = list(client.generate_stream(prompt, max_tokens=10, ignore_eos=True))
        info = client.model_info()
        ids = client.tokenize("hello world")
    assert [t for c in chunks for t in c.token_ids] == expected
    assert chunks[-1].usage.completion_tokens == 10
    assert info.prefill_workers == 1 and info.decode_workers == 2 and info.kv_transport == "grpc"
    assert ids


def test_async_client_and_errors(target):
    async def scenario():
        async with AsyncGenerationClient(target) as client:
            completion = await client.generate("Hello there", max_tokens=5, ignore_eos=True)
            assert len(completion.token_ids) == 5 and completion.finish_reason == "length"
            with pytest.raises(GenerationError) as error:
                await client.generate("Hello", top_p=2.0)
        return error.value

    error = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_p" in error.details


def test_admission_control_answers_resource_exhausted(served_app, target):
    config = served_app.app.routing.policy.config
    limit, config.max_pending_requests = config.max_pending_requests, 0
    try:
        with GenerationClient(target) as client, pytest.raises(GenerationError) as error:
            client.generate("Hello", max_tokens=2)
    finally:
        config.max_pending_requests = limit
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_api_keys_are_enforced_when_configured(served_app, target):
    auth = served_app.app.server.auth
    auth.api_keys = ["key-1", "key-2"]  # what RouterConfig.api_keys / PDSERVE_API_KEYS set
    try:
        with GenerationClient(target) as client, pytest.raises(GenerationError) as error:
            client.generate("Hello", max_tokens=2)
        with GenerationClient(target, api_key="key-2") as client:
            assert len(client.generate("Hello", max_tokens=2, ignore_eos=True).token_ids) == 2
    finally:
        auth.api_keys = []
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_two_clients_reusing_one_request_id_both_get_their_own_output(target):
    """The id a client picks is only echoed: workers know each request by a server-made id, so
    a duplicate neither fails nor aborts the other request."""
    prompts = [
        list(range(VOCAB_LOW + 100, VOCAB_LOW + 130)),
        list(range(VOCAB_LOW + 3, VOCAB_LOW + 20)),
    ]
    expected = reference_outputs(prompts, [40, 40])

    async def scenario():
        async with AsyncGenerationClient(target, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.generate(p, max_tokens=40, ignore_eos=True, request_id="same-id")
                    for p in prompts
                )
            )

    completions = asyncio.run(scenario())
    assert [c.token_ids for c in completions] == expected
    assert [c.finish_reason for c in completions] == ["length", "length"]
    assert [c.request_id for c in completions] == ["same-id", "same-id"]


def test_a_decode_worker_dying_mid_stream_does_not_change_the_output(served_app, target):
    """The router retries on the other decode worker, continuing after the tokens the client
    already has, so the client still gets exactly the greedy output of one uninterrupted run."""
    import ray

    prompt = list(range(VOCAB_LOW + 60, VOCAB_LOW + 90))
    expected = reference_outputs([prompt], [120])[0]
    with GenerationClient(target) as client:
        stream = client.generate_stream(prompt, max_tokens=120, ignore_eos=True)
        # The first token comes from the prefill worker, before its push into the decode worker
        # ends; the second from the decode worker's own stream. Killed before that, the decode
        # worker fails the push, which is charged to the prefill worker, and its restarted self
        # may take the retry: the case this test is about is a death mid-stream.
        sent = [next(stream), next(stream)]
        victim = sent[0].timings.decode_worker
        ray.kill(served_app.app.pool.workers[victim].actor, no_restart=False)
        rest = list(stream)
    tokens = [t for chunk in [*sent, *rest] for t in chunk.token_ids]
    assert tokens == expected
    assert rest[-1].timings.decode_worker != victim


def test_metrics_listen_on_the_configured_host_only(served_app):
    port = served_app.app.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert b"pdserve_requests_total" in response.read()
    # Linux routes all of 127.0.0.0/8 to the loopback device: a 0.0.0.0 listener would answer.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=10).close()
