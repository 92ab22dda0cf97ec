"""The served system's HTTP API (tests/openai/sdk/conftest.py) refusing bad requests with the
documented statuses, and a client that disconnects aborting its request on the workers."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client import REGISTRY

from tests.openai.served import KEY, LOW


def test_errors_have_the_documented_statuses(served, client, model):
    with pytest.raises(openai.BadRequestError, match=r"n: must be in \[1, 64\]"):
        client.completions.create(model=model, prompt="x", n=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="x")
    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.completions.create(model=model, prompt="x")
    router = served.app.config.router
    limit, router.max_pending_requests = router.max_pending_requests, 0  # admission refuses all
    try:
        with pytest.raises(openai.RateLimitError, match="overloaded"):
            client.completions.create(model=model, prompt="x", max_tokens=2)
        with pytest.raises(openai.RateLimitError, match="overloaded"):
            client.completions.create(model=model, prompt="x", max_tokens=2, stream=True)
    finally:
        router.max_pending_requests = limit


def used_blocks(served) -> dict[str, int]:
    import ray

    workers = served.app.pool.workers.values()
    return {w.worker_id: ray.get(w.actor.stats.remote()).num_used_blocks for w in workers}


def wait_idle(served, timeout_s: float = 15.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while any((used := used_blocks(served)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


def cancelled_requests() -> float:
    return REGISTRY.get_sample_value("pdserve_requests_total", {"outcome": "cancelled"}) or 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request_on_both_workers(served, model, stream):
    assert wait_idle(served) == dict.fromkeys(served.app.pool.workers, 0)
    cancelled = cancelled_requests()
    body = {
        "model": model,
        "prompt": list(range(LOW + 400, LOW + 440)),
        "max_tokens": 2000,  # with the prompt, the model's whole context: seconds of decoding
        "ignore_eos": True,
        "stream": stream,
    }
    url = f"http://127.0.0.1:{served.http_port}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    started = time.monotonic()
    if stream:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            assert response.status_code == 200
            first = next(response.iter_lines())
            assert first.startswith("data: {")
        # Leaving the block closed the connection mid-stream.
    else:
        with pytest.raises(httpx.ReadTimeout):  # gives up long before the last token
            httpx.post(url, json=body, headers=headers, timeout=1)
    assert wait_idle(served) == dict.fromkeys(served.app.pool.workers, 0)
    deadline = time.monotonic() + 5
    while cancelled_requests() < cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled_requests() == cancelled + 1
    assert time.monotonic() - started < 20
