"""Request validation at the API edge (router/validation.py): caps, ids, and tokenizing last."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.pb import generate_pb2
from router.validation import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
    ModelLimits,
    RequestError,
    ValidRequest,
    max_request_bytes,
    validate,
)

LIMITS = ModelLimits(
    name="tiny", vocab_size=512, max_model_len=2048, eos_token_ids=[1], max_prompt_bytes=1000
)


class CountingTokenizer:
    """Tokenizes one id per byte and counts its calls."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def __call__(self, text: str) -> list[int]:
        self.texts.append(text)
        return [b % 256 + 2 for b in text.encode()]


def run(request: generate_pb2.GenerateRequest, tokenize=None) -> ValidRequest:
    return asyncio.run(validate(request, LIMITS, tokenize or CountingTokenizer()))


def error_of(request: generate_pb2.GenerateRequest, tokenize=None) -> str:
    with pytest.raises(RequestError) as error:
        run(request, tokenize)
    return str(error.value)


def text_request(text: str = "hello", **sampling) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        text=text, sampling=generate_pb2.SamplingParams(max_tokens=4, **sampling)
    )


def test_an_oversized_text_prompt_is_refused_by_bytes_without_tokenizing() -> None:
    tokenize = CountingTokenizer()
    message = error_of(text_request("é" * 501), tokenize)  # 501 characters, 1002 bytes
    assert message == "prompt.text: 1002 bytes exceed the limit of 1000 bytes"
    assert tokenize.texts == []
    assert run(text_request("é" * 500)).prompt_ids  # 1000 bytes: at the limit, accepted


def test_tokenizing_comes_after_every_cheap_check() -> None:
    tokenize = CountingTokenizer()
    assert error_of(text_request(top_p=2.0), tokenize).startswith("sampling.top_p")
    assert tokenize.texts == []


def test_stop_token_ids_are_capped() -> None:
    too_many = text_request(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1))
    assert error_of(too_many) == (
        f"sampling.stop_token_ids: {MAX_STOP_TOKEN_IDS + 1} ids; "
        f"at most {MAX_STOP_TOKEN_IDS} are allowed"
    )
    assert run(text_request(stop_token_ids=[5] * MAX_STOP_TOKEN_IDS)).sampling.stop_token_ids


def test_stop_strings_are_capped_in_length() -> None:
    long = "x" * (MAX_STOP_STRING_CHARS + 1)
    assert error_of(text_request(stop=["ok", long])).startswith(
        f"sampling.stop: a stop string has {MAX_STOP_STRING_CHARS + 1} characters"
    )
    assert run(text_request(stop=["x" * MAX_STOP_STRING_CHARS])).sampling.stop


@pytest.mark.parametrize(
    "request_id", ["a\nb", "line\r", "tab\there", "sp ace", "naïve", "\x1b[2J"]
)
def test_request_ids_that_could_forge_log_lines_are_refused(request_id: str) -> None:
    request = text_request()
    request.request_id = request_id
    assert error_of(request) == (
        "request_id: only printable ASCII characters without spaces are allowed"
    )


def test_worker_ids_are_made_here_and_never_the_clients() -> None:
    request = text_request()
    request.request_id = "client-7:retry/1"
    first, second = run(request), run(request)
    assert first.request_id == second.request_id == "client-7:retry/1"
    assert first.work_id != second.work_id
    assert "client-7" not in first.work_id
    anonymous = run(text_request())
    assert anonymous.request_id == anonymous.work_id  # echoed: the logs and the client agree


def test_the_receive_limit_fits_the_largest_valid_request() -> None:
    largest = generate_pb2.GenerateRequest(
        request_id="r" * 256,
        model="tiny",
        text="é" * 500,
        sampling=generate_pb2.SamplingParams(
            stop=["s" * MAX_STOP_STRING_CHARS] * 16,
            stop_token_ids=[2**32 - 1] * MAX_STOP_TOKEN_IDS,
        ),
    )
    token_prompt = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[2**32 - 1] * LIMITS.max_model_len)
    )
    for request in (largest, token_prompt):
        assert request.ByteSize() <= max_request_bytes(LIMITS)
