"""Admission control counts the router's CPU pools: requests waiting to be tokenized (either
API) or to have their body decoded count against max_pending_requests like those on the
workers, so a full router refuses the next request at once, with the same answer
(RESOURCE_EXHAUSTED / 429), and `pdserve_router_pending` shows where they wait."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY

from pdserve.models.builtin import default_model_dir
from pdserve.pb import generate_pb2, generate_pb2_grpc
from router.bounded_pool import BoundedPool
from tests.e2e.test_disaggregated_serving import VOCAB_LOW
from tests.openai.served import builtin_config, serve

MAX_PENDING = 4
# A refusal that waited would wait for the held jobs (released only at the end, 30 s at most);
# one second separates the two on a loaded 2-core CI machine (0.33 s seen there, a connection
# set up per call).
AT_ONCE_S = 1.0
MODEL = default_model_dir().name


@pytest.fixture(scope="module")
def served(ray_cluster) -> Iterator:
    with serve(builtin_config(max_pending_requests=MAX_PENDING)) as app:
        yield app


def pending(stage: str) -> float | None:
    return REGISTRY.get_sample_value("pdserve_router_pending", {"stage": stage})


def text_generate(text: str) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        text=text, sampling=generate_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
    )


def refused_at_once(send) -> tuple[object, float]:
    started = time.monotonic()
    answer = send()
    return answer, time.monotonic() - started


@pytest.mark.parametrize("pool", ["grpc tokenize", "http tokenize", "request body"])
def test_a_router_full_of_pool_jobs_refuses_at_once_over_both_apis(served, pool):
    routing = served.app.routing
    # The pools in the order the app counts them: gRPC's tokenizer, then the HTTP API's two.
    pools = [q for q in routing.queues if isinstance(q, BoundedPool)]
    queue = pools[{"grpc tokenize": 0, "http tokenize": 1, "request body": 2}[pool]]
    stage = queue.name.replace(" ", "_")
    release = threading.Event()
    # Jobs that hold the pool until released: requests still being tokenized or decoded.
    held = [
        asyncio.run_coroutine_threadsafe(queue.run(release.wait, 30), served.loop)
        for _ in range(MAX_PENDING)
    ]
    base = f"http://127.0.0.1:{served.http_port}"
    try:
        deadline = time.monotonic() + 5
        while routing.pending() < MAX_PENDING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert routing.pending() == MAX_PENDING
        metrics = httpx.get(f"{base}/metrics").text
        assert f'pdserve_router_pending{{stage="{stage}"}} {float(MAX_PENDING)}' in metrics
        assert pending("workers") == 0

        with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            for request in (
                text_generate("hello there"),
                generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[VOCAB_LOW] * 4)),
            ):
                error, took = refused_at_once(lambda r=request: _grpc_error(stub, r))
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                assert "max_pending_requests=4" in error.details()
                assert took < AT_ONCE_S
        for path, body in (
            ("/v1/completions", {"prompt": "hello there"}),
            ("/v1/completions", {"prompt": [VOCAB_LOW] * 4}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            response, took = refused_at_once(
                lambda p=path, b=body: httpx.post(
                    f"{base}{p}", json={"model": MODEL, "max_tokens": 2} | b, timeout=10
                )
            )
            assert response.status_code == 429, response.text
            assert "max_pending_requests=4" in response.json()["error"]["message"]
            assert took < AT_ONCE_S
    finally:
        release.set()
        assert [job.result(10) for job in held] == [True] * MAX_PENDING
    assert routing.pending() == 0 and pending(stage) == 0
    # Drained, it serves again.
    response = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": "hello there", "max_tokens": 2, "ignore_eos": True},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def _grpc_error(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(request, timeout=10))
    return raised.value
