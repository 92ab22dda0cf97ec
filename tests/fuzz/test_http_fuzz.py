"""Fuzzing the OpenAI HTTP API of a live system: completions and chat completions, as bodies
drawn from the schema the app documents (`app.openapi()`) and as malformed mutations of them.

One served system (1 prefill + 1 decode worker, real Ray, the router's real HTTP port, an API
key) takes every case over a keep-alive connection. Every answer must carry a status the route
documents, never a 500; errors are OpenAI error bodies naming the field; a 200 is a whole
completion (or an event stream that ends in `[DONE]` with no internal error in it).
Afterwards the server still serves exact greedy output and no worker holds a block,
reservation or transfer. `PDSERVE_HTTP_FUZZ_EXAMPLES` sets the number of cases over the
whole suite (2,000 by default, split by SHARES).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from pdserve.bench.common.system_probe import settled_leftovers
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import VOCAB_LOW, reference_outputs
from tests.fuzz import http_cases
from tests.fuzz.http_cases import Case

TOTAL_EXAMPLES = int(os.environ.get("PDSERVE_HTTP_FUZZ_EXAMPLES", "2000"))
SHARES = {"completions": 0.3, "chat": 0.2, "completions_mutated": 0.3, "chat_mutated": 0.2}
KEY = "sk-fuzz"
CALL_TIMEOUT_S = 30.0  # per request: a hung request fails the case instead of the suite
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_TOKENS_FIELDS = {
    "completions": ("max_tokens",),
    "chat": ("max_tokens", "max_completion_tokens"),
}


def fuzz_settings(share: str) -> settings:
    return settings(
        max_examples=max(1, round(TOTAL_EXAMPLES * SHARES[share])),
        deadline=None,  # the request timeout bounds each case
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,  # a failure prints the blob that replays it (@reproduce_failure)
    )


@pytest.fixture(scope="module")
def served(ray_cluster) -> Iterator:
    from pdserve.app import BackgroundApp

    config = serve_config("grpc", prefill_workers=1, decode_workers=1)
    config.router.api_keys = [KEY]
    with BackgroundApp(config) as app:
        yield app


@pytest.fixture(scope="module")
def client(served) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{served.http_port}"
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base, headers=headers, timeout=CALL_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def openapi(tmp_path_factory) -> dict:
    """The app's OpenAPI document (the routes' schemas do not depend on what serves them)."""
    from tests.openai.test_http_edge import make_client

    return make_client(Path(tmp_path_factory.mktemp("model"))).app.openapi()


@pytest.fixture(scope="module")
def model(client) -> tuple[str, int]:
    card = client.get("/v1/models").json()["data"][0]
    from pdserve.models.builtin import default_model_dir
    from pdserve.tokenizer import Tokenizer

    return card["id"], Tokenizer.from_dir(default_model_dir()).vocab_size


def route(openapi: dict, name: str) -> tuple[dict, set[int]]:
    """The route's documented body schema and statuses."""
    operation = openapi["paths"][PATHS[name]]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    return schema, {int(status) for status in operation["responses"]}


def check(client: httpx.Client, name: str, case: Case, statuses: set[int]) -> int:
    headers = {"content-type": "application/json"}
    if not case.authorized:
        headers["authorization"] = "Bearer not-the-key"
    with client.stream(case.method, PATHS[name], content=case.data, headers=headers) as response:
        body = response.read()
    status = response.status_code
    assert status in statuses, (status, body[:300], case)
    if status != 200:
        error = json.loads(body)["error"]
        assert error["message"] and "Traceback" not in error["message"], error
        assert error["type"] != "internal_error", error
        if status == 400:
            assert error["param"], error  # the message names the field
    expected = {"unauthorized": 401, "wrong_method": 405}.get(case.kind)
    if expected:
        assert status == expected, (status, body[:300], case.kind)
    if case.kind == "surrogate":
        assert status == 400 and "not valid Unicode" in error["message"], (status, body[:300])
    elif case.kind in ("not_json", "not_object"):
        assert status == 400, (status, body[:300], case.data[:100])
    if status == 200:
        check_completion(response.headers["content-type"], body)
    return status


def check_completion(content_type: str, body: bytes) -> None:
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in map(json.loads, events[:-1]):
            if "error" in event:  # failed after its first chunk: still a client's error
                assert event["error"]["type"] != "internal_error", event
        return
    completion = json.loads(body)
    assert completion["choices"], completion
    assert all(c["finish_reason"] in ("stop", "length") for c in completion["choices"])


def assert_still_serving_and_clean(served, client: httpx.Client, model: str) -> None:
    prompt = list(range(VOCAB_LOW + 3, VOCAB_LOW + 29))
    response = client.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        | {"temperature": 0, "return_token_ids": True},
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == reference_outputs([prompt], [6])[0]
    left = settled_leftovers(served.app)
    assert all(w.clean for w in left.values()), left


@pytest.mark.parametrize("name", ["completions", "chat"])
def test_drawn_from_the_documented_schema(served, client, openapi, model, name):
    schema, statuses = route(openapi, name)
    cheap = http_cases.cheap(schema, *model, MAX_TOKENS_FIELDS[name])

    seen: Counter[int] = Counter()

    @fuzz_settings(name)
    @given(case=http_cases.drawn(cheap))
    def case(case: Case) -> None:
        seen[check(client, name, case, statuses)] += 1

    case()
    # The schema's cases reach the workers, not only validation.
    assert seen[200] >= sum(seen.values()) // 10 and seen[400], seen
    assert_still_serving_and_clean(served, client, model[0])


@pytest.mark.parametrize("name", ["completions", "chat"])
def test_malformed_mutations(served, client, openapi, model, name):
    schema, statuses = route(openapi, name)
    cheap = http_cases.cheap(schema, *model, MAX_TOKENS_FIELDS[name])

    seen: Counter[int] = Counter()

    @fuzz_settings(f"{name}_mutated")
    @given(case=http_cases.mutated(cheap))
    def case(case: Case) -> None:
        seen[check(client, name, case, statuses)] += 1

    case()
    assert seen[400], seen
    assert_still_serving_and_clean(served, client, model[0])
