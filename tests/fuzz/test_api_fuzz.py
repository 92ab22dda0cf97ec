"""Fuzzing the gRPC API of a live system: Generate and Tokenize, as messages and as raw bytes.

One served system (1 prefill + 1 decode worker, real Ray, real gRPC) takes every case. Each
answer must be what the documented rules say (tests/fuzz/cases.py: complete, or
INVALID_ARGUMENT naming the field); afterwards the server still serves exact greedy output and
no worker holds a block, reservation or transfer. `PDSERVE_FUZZ_EXAMPLES` sets the number of
cases over the whole suite (2,000 by default, split by SHARES).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings

from pdserve.bench.common.system_probe import settled_leftovers
from pdserve.pb import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import VOCAB_HIGH, VOCAB_LOW, reference_outputs
from tests.fuzz import cases

TOTAL_EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "2000"))
SHARES = {"generate": 0.55, "tokenize": 0.2, "generate_bytes": 0.15, "tokenize_bytes": 0.1}
CALL_TIMEOUT_S = 30.0  # per RPC: a hung request fails the case instead of the suite's timeout
GENERATE = "/pdserve.v1.Generation/Generate"
TOKENIZE = "/pdserve.v1.Generation/Tokenize"
OK = grpc.StatusCode.OK


def fuzz_settings(share: str) -> settings:
    return settings(
        max_examples=max(1, round(TOTAL_EXAMPLES * SHARES[share])),
        deadline=None,  # the RPC timeout bounds each case
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,  # a failure prints the blob that replays it (@reproduce_failure)
    )


@pytest.fixture(scope="module")
def served(ray_cluster) -> Iterator:
    from pdserve.app import BackgroundApp

    with BackgroundApp(serve_config("grpc", prefill_workers=1, decode_workers=1)) as app:
        yield app


@pytest.fixture(scope="module")
def channel(served) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def model(channel) -> cases.Model:
    info = generate_pb2_grpc.GenerationStub(channel).GetModelInfo(
        generate_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S
    )
    return cases.Model(info.name, info.vocab_size, info.max_model_len, _tokenizer().encode)


def _tokenizer():
    from pdserve.models.builtin import default_model_dir
    from pdserve.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir())


def call_generate(
    channel: grpc.Channel, data: bytes
) -> tuple[list[generate_pb2.GenerateResponse], grpc.StatusCode, str]:
    """Sends `data` as a serialized GenerateRequest; (responses, status, details)."""
    call = channel.unary_stream(
        GENERATE,
        request_serializer=None,
        response_deserializer=generate_pb2.GenerateResponse.FromString,
    )(data, timeout=CALL_TIMEOUT_S)
    responses: list[generate_pb2.GenerateResponse] = []
    try:
        responses.extend(call)
    except grpc.RpcError as error:
        return responses, error.code(), error.details() or ""
    return responses, OK, ""


def call_tokenize(
    channel: grpc.Channel, data: bytes
) -> tuple[generate_pb2.TokenizeResponse | None, grpc.StatusCode, str]:
    method = channel.unary_unary(
        TOKENIZE,
        request_serializer=None,
        response_deserializer=generate_pb2.TokenizeResponse.FromString,
    )
    try:
        return method(data, timeout=CALL_TIMEOUT_S), OK, ""
    except grpc.RpcError as error:
        return None, error.code(), error.details() or ""


def check_generate(channel, model: cases.Model, data: bytes) -> None:
    responses, code, details = call_generate(channel, data)
    try:
        request = generate_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        # Not a GenerateRequest (bad wire format, invalid UTF-8 in a string field).
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        return
    verdict = cases.judge(request, model)
    if verdict.must_reject:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, verdict.must_reject)
        named = verdict.must_reject | verdict.may_reject
        assert details.startswith(tuple(named)), (details, named)
    elif code != OK:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert verdict.may_reject and details.startswith(tuple(verdict.may_reject)), details
    else:
        check_completion(request, verdict, model, responses)


def check_completion(request, verdict: cases.Verdict, model: cases.Model, responses) -> None:
    assert responses, "a stream that ended OK without a response"
    last = responses[-1]
    assert last.finish_reason in (
        generate_pb2.FINISH_REASON_STOP,
        generate_pb2.FINISH_REASON_LENGTH,
    )
    assert all(r.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    request_id = request.request_id or responses[0].request_id
    assert request_id and all(r.request_id == request_id for r in responses)
    ids = [t for r in responses for t in r.token_ids]
    assert 1 <= len(ids) <= verdict.max_tokens
    assert all(t < model.vocab_size for t in ids)
    assert last.usage.completion_tokens == len(ids)
    assert last.usage.prompt_tokens == verdict.prompt_tokens
    if last.finish_reason == generate_pb2.FINISH_REASON_LENGTH:
        assert len(ids) == verdict.max_tokens or (
            verdict.prompt_tokens + len(ids) == model.max_model_len
        )
    logprobs = [p for r in responses for p in r.logprobs]
    if request.sampling.logprobs:
        assert len(logprobs) == len(ids) and all(p <= 1e-4 for p in logprobs)
    else:
        assert not logprobs


def check_tokenize(channel, model: cases.Model, tokenizer, data: bytes) -> None:
    response, code, details = call_tokenize(channel, data)
    try:
        request = generate_pb2.TokenizeRequest.FromString(data)
    except DecodeError:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        return
    if request.model not in ("", model.name):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details.startswith("model"), details
        return
    assert code == OK, (code, details)
    expected = tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
    assert list(response.token_ids) == expected
    assert len(response.tokens) == len(expected)


def assert_still_serving_and_clean(served, channel) -> None:
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    prompt = list(range(VOCAB_LOW + 3, VOCAB_LOW + 29))
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=6, ignore_eos=True),
    )
    responses, code, details = call_generate(channel, request.SerializeToString())
    assert code == OK, details
    assert [t for r in responses for t in r.token_ids] == reference_outputs([prompt], [6])[0]
    left = settled_leftovers(served.app)
    assert all(w.clean for w in left.values()), left


def test_generate_messages(served, channel, model):
    @fuzz_settings("generate")
    @given(request=cases.generate_requests(model))
    def case(request: generate_pb2.GenerateRequest) -> None:
        check_generate(channel, model, request.SerializeToString())

    case()
    assert_still_serving_and_clean(served, channel)


def test_tokenize_messages(served, channel, model):
    tokenizer = _tokenizer()

    @fuzz_settings("tokenize")
    @given(request=cases.tokenize_requests(model))
    def case(request: generate_pb2.TokenizeRequest) -> None:
        check_tokenize(channel, model, tokenizer, request.SerializeToString())

    case()
    assert_still_serving_and_clean(served, channel)


def test_generate_raw_bytes(served, channel, model):
    @fuzz_settings("generate_bytes")
    @given(data=cases.raw_bytes(cases.generate_requests(model)))
    def case(data: bytes) -> None:
        check_generate(channel, model, data)

    case()
    assert_still_serving_and_clean(served, channel)


def test_tokenize_raw_bytes(served, channel, model):
    tokenizer = _tokenizer()

    @fuzz_settings("tokenize_bytes")
    @given(data=cases.raw_bytes(cases.tokenize_requests(model)))
    def case(data: bytes) -> None:
        check_tokenize(channel, model, tokenizer, data)

    case()
    assert_still_serving_and_clean(served, channel)


SMALL_REQUEST_S = 3.0  # a 2-token request next to an oversized one (load on 2 shared cores)


@pytest.mark.parametrize(
    "prompt",
    [
        {"text": "a" * ((4 << 20) + 1024)},  # over the prompt byte limit
        {"text": "ab " * (1 << 18)},  # under it, but far over the context
        {"token_ids": {"ids": [7] * 1_000_000}},
    ],
    ids=["text-over-4MiB", "text-768KiB", "token-ids-1M"],
)
def test_oversized_prompts_are_refused_and_others_still_served(served, channel, prompt):
    request = generate_pb2.GenerateRequest(**prompt)
    with ThreadPoolExecutor(max_workers=1) as pool:
        oversized = pool.submit(call_generate, channel, request.SerializeToString())
        # While the router handles it, a small request is still answered at once.
        small = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=[VOCAB_LOW] * 8),
            sampling=generate_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        started = time.monotonic()
        _, code, details = call_generate(channel, small.SerializeToString())
        assert code == OK, details
        assert time.monotonic() - started < SMALL_REQUEST_S
        _, code, details = oversized.result()
    # Too big for the transport (RESOURCE_EXHAUSTED) or for the context (naming the prompt).
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details.startswith("prompt"), details
    assert_still_serving_and_clean(served, channel)


def test_concurrent_requests_sharing_a_request_id(served, channel):
    """Clients may reuse ids: each stream still gets its own exact output (or a clear
    INVALID_ARGUMENT naming request_id), and nothing of either request is left behind."""
    rng = random.Random(13)
    prompts = [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(8, 40))] for _ in range(8)
    ]
    expected = reference_outputs(prompts, [5] * len(prompts))

    def run(i: int):
        request = generate_pb2.GenerateRequest(
            request_id=f"shared-{i % 2}",
            token_ids=generate_pb2.TokenIds(ids=prompts[i]),
            sampling=generate_pb2.SamplingParams(max_tokens=5, ignore_eos=True),
        )
        return call_generate(channel, request.SerializeToString())

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(run, range(len(prompts))))
    for i, (responses, code, details) in enumerate(results):
        if code == OK:
            assert [t for r in responses for t in r.token_ids] == expected[i], i
        else:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert details.startswith("request_id"), details
    assert sum(code == OK for _, code, _ in results) >= 2  # one per id at least
    assert_still_serving_and_clean(served, channel)
