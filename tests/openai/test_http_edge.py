"""The OpenAI HTTP API's edge without workers: validation, errors, auth, probes, metrics.

The app runs in-process under FastAPI's TestClient with no RequestFlow behind it, so these
tests cover everything that happens before a request reaches the workers; the served system is
tested in tests/openai/sdk/.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from pdserve.models.tokenizer_builder import write_tokenizer
from pdserve.tokenizer import Tokenizer
from router.auth import ApiKeyInterceptor
from router.errors import status_for
from router.http.api import create_app
from router.http.chat_template import ChatTemplate
from router.http.errors import status_and_body
from router.http.request_body import max_body_bytes
from router.http.service import OpenAIService
from router.tokenizing import BackgroundTokenizer
from router.types import NoWorkerAvailable, Overloaded
from router.validation import ModelLimits

MODEL = "tiny"
KEY = "sk-test-key"


def make_client(directory: Path, *, keys=(), ready=True, template=True) -> TestClient:
    write_tokenizer(directory, 512)
    limits = ModelLimits(MODEL, 512, 256, [1], max_prompt_bytes=1000)
    service = OpenAIService(
        None,  # no RequestFlow: a request that passes validation fails with 500
        BackgroundTokenizer(Tokenizer.from_dir(directory)),
        limits,
        chat_template=ChatTemplate.from_dir(directory) if template else None,
    )
    app = create_app(service, ApiKeyInterceptor(keys), lambda: ready)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    return make_client(tmp_path_factory.mktemp("model"))


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert "Traceback" not in json.dumps(body)
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", completion(temperature=-1), "temperature", "must be >= 0"),
        ("/v1/completions", completion(top_p=0), "top_p", "(0, 1]"),
        ("/v1/completions", completion(min_p=1.5), "min_p", "[0, 1]"),
        ("/v1/chat/completions", chat(min_p=-0.1), "min_p", "[0, 1]"),
        ("/v1/completions", completion(max_tokens=0), "max_tokens", ">= 1"),
        ("/v1/completions", completion(max_tokens=300), "max_tokens", "exceeds the context"),
        ("/v1/completions", completion(n=0), "n", "[1, 64]"),
        ("/v1/completions", completion(n=65), "n", "[1, 64]"),
        ("/v1/completions", completion(n=3, beam_width=2), "n", "beam_width 2"),
        ("/v1/completions", completion(logprobs=3), "logprobs", "only 0"),
        ("/v1/completions", completion(echo=True), "echo", "not supported"),
        ("/v1/completions", completion(presence_penalty=0.5), "presence_penalty", "not supported"),
        ("/v1/completions", completion(seed=-1), "seed", "[0, 2^64)"),
        ("/v1/completions", completion(max_tokens=4, min_tokens=5), "min_tokens", "max_tokens"),
        ("/v1/completions", completion(min_tokens=-1), "min_tokens", ">= 0"),
        ("/v1/completions", completion(min_tokens=2, beam_width=2), "min_tokens", "beam search"),
        ("/v1/completions", completion(prompt=""), "prompt", "empty prompt"),
        ("/v1/completions", completion(prompt=[]), "prompt", "empty list"),
        ("/v1/completions", completion(prompt=[5, 9999]), "prompt", "outside the vocabulary"),
        ("/v1/completions", completion(prompt=[5, -1]), "prompt", "outside the vocabulary"),
        ("/v1/completions", completion(prompt=["a", ""]), "prompt[1]", "empty prompt"),
        ("/v1/completions", completion(prompt="x" * 1001), "prompt", "exceed the limit"),
        ("/v1/completions", completion(stop=[""]), "stop", "non-empty"),
        ("/v1/completions", completion(stop_token_ids=[600]), "stop_token_ids", "vocabulary"),
        ("/v1/completions", completion(top_k=-2), "top_k", ">= 0"),
        ("/v1/completions", completion(beam_width=2, temperature=1), "beam_width", "greedy"),
        ("/v1/completions", completion(dola_layers="mid"), "dola_layers", '"low", "high"'),
        ("/v1/completions", completion(dola_layers=[-1]), "dola_layers", ">= 0"),
        ("/v1/completions", completion(sled_layers="low"), "sled_layers", "needs sled"),
        ("/v1/completions", completion(repetition_penalty=0), "repetition_penalty", "> 0"),
        ("/v1/chat/completions", chat(sled=True, evolution_scale=0), "evolution_scale", ">= 1"),
        (
            "/v1/completions",
            completion(stream_options={"include_usage": True}),
            "stream_options",
            "stream",
        ),
        ("/v1/completions", completion(prompt=3), "prompt", "valid"),
        ("/v1/completions", completion(temperature="hot"), "temperature", "valid number"),
        ("/v1/completions", {"model": MODEL}, "prompt", "required"),
        ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs", "only 0"),
        ("/v1/chat/completions", chat(max_completion_tokens=0), "max_completion_tokens", ">= 1"),
        (
            "/v1/chat/completions",
            chat(max_completion_tokens=300),
            "max_completion_tokens",
            "context",
        ),
        ("/v1/chat/completions", chat(tools=[{"type": "function"}]), "tools[0].function", "name"),
        (
            "/v1/chat/completions",
            chat(tools=[{"type": "function", "function": {"name": "f"}}]),
            "tools",
            "chat template does not render tools",
        ),
        (
            "/v1/chat/completions",
            chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]
            ),
            "tools[0].function.parameters.type",
            "not a valid JSON schema",
        ),
        ("/v1/chat/completions", chat(messages=[]), "messages", "at least 1"),
        ("/v1/chat/completions", chat(messages=[{"content": "x"}]), "messages[0].role", "required"),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0]",
            "only text parts",
        ),
        (
            "/v1/chat/completions",
            chat(chat_template_kwargs={"messages": []}),
            "chat_template_kwargs",
            "set by the server",
        ),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, path, body, param, words) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_invalid_json_is_400(client) -> None:
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "not valid JSON" in error_of(response)["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_model_is_404(client, path) -> None:
    body = chat(model="gpt-4") if "chat" in path else completion(model="gpt-4")
    response = client.post(path, json=body)
    assert response.status_code == 404
    error = error_of(response)
    assert error["code"] == "model_not_found" and "'gpt-4'" in error["message"]
    assert client.get("/v1/models/gpt-4").status_code == 404


def test_a_valid_request_with_no_worker_path_is_a_500_without_traceback(client) -> None:
    response = client.post("/v1/completions", json=completion(max_tokens=4))
    assert response.status_code == 500
    assert error_of(response)["message"].startswith("internal error: ")


def test_chat_without_a_template_is_a_clear_400(tmp_path) -> None:
    client = make_client(tmp_path, template=False)
    response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "messages" and "no chat template" in error["message"]


def test_a_template_refusing_the_conversation_is_400(client) -> None:
    # The built-in template concatenates content: a missing content fails to render.
    response = client.post(
        "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": None}])
    )
    assert response.status_code == 400
    assert "chat template refused" in error_of(response)["message"]


def test_api_keys_guard_the_v1_routes_but_not_the_probes(tmp_path) -> None:
    client = make_client(tmp_path, keys=[KEY])
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        response = client.post("/v1/completions", json=completion(), headers=headers)
        assert response.status_code == 401
        assert "API key" in error_of(response)["message"]
        assert client.get("/v1/models", headers=headers).status_code == 401
    good = {"Authorization": f"bearer {KEY}"}
    assert client.get("/v1/models", headers=good).json()["data"][0]["id"] == MODEL
    response = client.post("/v1/completions", json=completion(temperature=-1), headers=good)
    assert response.status_code == 400  # authenticated, then validated
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_models_lists_the_served_model(client) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL] and data[0]["max_model_len"] == 256
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_ready_is_503_without_a_decode_worker(tmp_path) -> None:
    client = make_client(tmp_path, ready=False)
    assert client.get("/health").status_code == 200
    response = client.get("/ready")
    assert response.status_code == 503 and "decode worker" in error_of(response)["message"]


def test_metrics_serves_the_prometheus_registry(client) -> None:
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert "pdserve_requests_total" in response.text


def test_unknown_paths_answer_in_openai_error_form(client) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and error_of(response)["message"] == "Not Found"


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (Overloaded("router overloaded"), 429, "rate_limit_error"),
        (NoWorkerAvailable("no healthy decode worker"), 503, "service_unavailable_error"),
        (RuntimeError("boom"), 500, "internal_error"),
    ],
)
def test_router_errors_map_to_http_status_like_grpc(exc, status, kind) -> None:
    got, body = status_and_body(exc)
    assert (got, body["error"]["type"]) == (status, kind)
    assert body["error"]["message"] == status_for(exc)[1]
    assert (
        status_for(exc)[0]
        in {
            429: {grpc.StatusCode.RESOURCE_EXHAUSTED},
            503: {grpc.StatusCode.UNAVAILABLE},
            500: {grpc.StatusCode.INTERNAL},
        }[status]
    )


def test_an_oversized_body_is_413_before_it_is_read(client) -> None:
    limit = max_body_bytes(ModelLimits(MODEL, 512, 256, [1], max_prompt_bytes=1000))
    body = json.dumps(completion(prompt="x" * limit)).encode()
    declared = client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert declared.status_code == 413
    assert error_of(declared)["message"] == f"body: larger than the limit of {limit} bytes"

    def chunks():  # no Content-Length: counted as it arrives
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    chunked = client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert chunked.status_code == 413
    small = client.post("/v1/completions", json=completion(prompt="x" * 900, max_tokens=0))
    assert small.status_code == 400  # under the cap: read and validated


def test_a_wrong_method_is_405_typed_as_an_invalid_request(client) -> None:
    response = client.get("/v1/completions")
    assert response.status_code == 405
    assert error_of(response)["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_model_is_optional_as_in_vllm(client, path) -> None:
    """Without `model` the served one is meant: the request is validated on (a bad field is
    still named) and reaches the workers (none here: a 500)."""
    body = chat() if "chat" in path else completion()
    del body["model"]
    response = client.post(path, json={**body, "temperature": -1})
    assert response.status_code == 400 and error_of(response)["param"] == "temperature"
    response = client.post(path, json={**body, "max_tokens": 4})
    assert response.status_code == 500
    assert error_of(response)["message"].startswith("internal error: ")


@pytest.mark.parametrize(
    ("path", "raw", "param", "words"),
    [
        # Strict JSON types: nothing is coerced.
        ("/v1/completions", completion(max_tokens=True), "max_tokens", "valid integer"),
        ("/v1/completions", completion(max_tokens="8"), "max_tokens", "valid integer"),
        ("/v1/completions", completion(max_tokens=8.0), "max_tokens", "valid integer"),
        ("/v1/completions", completion(prompt=[True, False]), "prompt", "valid"),
        ("/v1/completions", completion(stream="yes"), "stream", "valid boolean"),
        ("/v1/completions", completion(n="2"), "n", "valid integer"),
        # Text that is not Unicode: a lone surrogate, which JSON can spell.
        ("/v1/completions", completion(prompt="a\ud800b"), "prompt", "not valid Unicode"),
        ("/v1/completions", completion(prompt=["ok", "\udfff"]), "prompt[1]", "not valid Unicode"),
        ("/v1/completions", completion(stop=["\ud800"]), "stop[0]", "not valid Unicode"),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "\ud800"}]),
            "messages[0].content",
            "not valid Unicode",
        ),
        # Integers beyond what the request can carry.
        ("/v1/completions", completion(top_k=2**31), "top_k", "< 2^31"),
        ("/v1/completions", completion(top_k=-(2**40)), "top_k", ">= 0"),
        # One request's size: sequences, messages, text.
        ("/v1/completions", completion(prompt=["a", "b"], n=33), "n", "66 sequences"),
        ("/v1/completions", completion(prompt=[[5]] * 65), "prompt", "at most 64"),
        ("/v1/chat/completions", chat(messages=[{"role": "user"}] * 1025), "messages", "1024"),
        ("/v1/completions", completion(prompt=["y" * 20000] * 60), "prompt", "per request"),
    ],
)
def test_malformed_values_are_400_naming_the_field(client, path, raw, param, words) -> None:
    content = json.dumps(raw).encode()  # ASCII: a lone surrogate spelled as JSON escapes it
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "prompt": "x", "max_tokens": NaN}',
        b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",
        b'{"model": "tiny", "prompt": "\xff\xfe"}',
        b"[" * 100_000,
        b'["model"]',
    ],
    ids=["nan", "5000-digit-int", "invalid-utf8", "deep-nesting", "not-an-object"],
)
def test_bodies_that_are_not_json_objects_are_400(client, raw) -> None:
    response = client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert error_of(response)["message"].startswith("body: ")


def test_the_api_key_is_checked_before_the_body_is_read(tmp_path) -> None:
    """Unauthenticated, the request is refused without a single body read, and the connection
    is closed (the client may still be sending)."""
    app = make_client(tmp_path, keys=[KEY]).app
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    reads, sent = [], []

    async def receive() -> dict:
        reads.append(1)
        await asyncio.sleep(3600)  # the body never comes
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    start = sent[0]
    assert start["status"] == 401 and (b"connection", b"close") in start["headers"]
    assert not reads
