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


def test_min_p_outside_zero_to_one_is_refused_by_name() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        assert error_of(text_request(min_p=bad)).startswith("sampling.min_p: must be in [0, 1]")
    assert run(text_request(min_p=0.05)).sampling.min_p == pytest.approx(0.05)


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


def test_decoding_rule_fields_reach_sampling_params() -> None:
    beam = run(text_request(n=2, beam_width=4, length_penalty=0.5, early_stopping=True)).sampling
    assert (beam.n, beam.beam_width, beam.length_penalty, beam.early_stopping) == (2, 4, 0.5, True)
    dola = text_request(
        repetition_penalty=1.2,
        dola_layers=generate_pb2.LayerSelection(indices=generate_pb2.LayerIndices(layers=[0, 2])),
    )
    assert run(dola).sampling.dola_layers == [0, 2]
    assert run(dola).sampling.repetition_penalty == pytest.approx(1.2)
    sled = run(
        text_request(
            sled=True,
            sled_layers=generate_pb2.LayerSelection(preset="high"),
            evolution_rate=1.5,
            evolution_scale=5,
            evolution_lower_bound=-50.0,
        )
    ).sampling
    assert (sled.sled, sled.sled_layers, sled.evolution_scale) == (True, "high", 5)
    assert (sled.evolution_rate, sled.evolution_lower_bound) == (1.5, -50.0)
    plain = run(text_request()).sampling
    assert (plain.n, plain.beam_width, plain.dola_layers, plain.sled) == (1, 0, None, False)


@pytest.mark.parametrize(
    ("sampling", "prefix"),
    [
        ({"n": 0}, "sampling.n:"),
        ({"n": 65}, "sampling.n:"),
        ({"beam_width": 2, "n": 3}, "sampling.n:"),
        ({"beam_width": 2, "temperature": 1.0}, "sampling.beam_width:"),
        ({"beam_width": 2, "stop": ["x"]}, "sampling.stop:"),
        ({"repetition_penalty": -1.0}, "sampling.repetition_penalty:"),
        ({"length_penalty": float("inf")}, "sampling.length_penalty:"),
        ({"dola_layers": generate_pb2.LayerSelection(preset="mid")}, "sampling.dola_layers:"),
        (
            {"dola_layers": generate_pb2.LayerSelection(preset="low"), "sled": True},
            "sampling.dola_layers:",
        ),
        ({"sled_layers": generate_pb2.LayerSelection(preset="low")}, "sampling.sled_layers:"),
        ({"sled": True, "evolution_scale": 0}, "sampling.evolution_scale:"),
        ({"sled": True, "evolution_rate": 0.0}, "sampling.evolution_rate:"),
    ],
)
def test_bad_decoding_rules_name_the_field(sampling: dict, prefix: str) -> None:
    assert error_of(text_request(**sampling)).startswith(prefix)


def test_layer_indices_must_precede_the_final_layer() -> None:
    limits = ModelLimits("tiny", 512, 2048, [1], num_layers=4)
    deep = text_request(
        dola_layers=generate_pb2.LayerSelection(indices=generate_pb2.LayerIndices(layers=[1, 4]))
    )
    with pytest.raises(RequestError, match=r"^sampling.dola_layers: layer 4"):
        asyncio.run(validate(deep, limits, CountingTokenizer()))


def test_the_speculation_opt_out_reaches_sampling_params() -> None:
    assert run(text_request()).sampling.speculative
    assert not run(text_request(disable_speculation=True)).sampling.speculative
    # The engine, not the API, leaves decoding rules it cannot speculate on unspeculated.
    beam = run(text_request(beam_width=2, disable_speculation=False)).sampling
    assert beam.speculative and beam.beam_width == 2
