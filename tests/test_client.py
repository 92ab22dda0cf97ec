"""The Python client and `pdserve generate`, against a real gRPC server (tests/bench/echo_server)."""

from __future__ import annotations

import argparse
import asyncio
import json

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from pdserve.client import (
    AsyncGenerationClient,
    Completion,
    GenerationClient,
    GenerationError,
    build_request,
)
from pdserve.commands import generate as generate_command
from pdserve.pb import generate_pb2
from tests.bench.echo_server import EchoServer, EchoServicer, word_ids

API_KEY = "s3cret"
TRACE_ID, SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def server():
    with EchoServer(EchoServicer(token_delay_s=0.002, api_key=API_KEY)) as echo:
        yield echo


def _current_span():
    context = SpanContext(TRACE_ID, SPAN_ID, is_remote=False, trace_flags=TraceFlags(1))
    return trace.use_span(NonRecordingSpan(context))


def test_sync_stream_arrives_in_order_and_assembles_a_completion(server):
    with GenerationClient(server.target, api_key=API_KEY) as client:
        chunks = list(client.generate_stream([5, 6, 7], max_tokens=7, ignore_eos=True))
        completion = client.generate([5, 6, 7], max_tokens=7, logprobs=True, request_id="r1")
    assert [list(c.token_ids) for c in chunks] == [[5], [6], [7], [5], [6], [7], [5]]
    assert chunks[0].timings.prefill_worker == "prefill-0"
    assert [c.finish_reason for c in chunks][-2:] == [0, 2]
    assert completion.request_id == "r1"
    assert completion.token_ids == [5, 6, 7, 5, 6, 7, 5]
    assert completion.text == "<5><6><7><5><6><7><5>"
    assert completion.logprobs == [-0.5] * 7
    assert completion.finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 7)
    assert completion.timings.decode_worker == "decode-0"  # the last response's timings win


def test_multi_token_responses_and_stop_tokens(server):
    server.servicer.tokens_per_chunk = 3
    with GenerationClient(server.target, api_key=API_KEY) as client:
        chunks = list(client.generate_stream([1, 2, 3, 4], max_tokens=5))
        stopped = client.generate([1, 2, 3, 4], max_tokens=10, stop_token_ids=[3])
    assert [list(c.token_ids) for c in chunks] == [[1, 2, 3], [4, 1]]
    assert stopped.token_ids == [1, 2, 3] and stopped.finish_reason == "stop"


def test_sync_metadata_carries_api_key_traceparent_and_extras(server):
    with GenerationClient(server.target, api_key=API_KEY, metadata={"X-Tenant": "t1"}) as client:
        client.generate("hello", max_tokens=1)
        with _current_span():
            client.generate("hello", max_tokens=1)
    without_span, with_span = server.servicer.metadata
    assert without_span["authorization"] == f"Bearer {API_KEY}"
    assert without_span["x-tenant"] == "t1"
    assert "traceparent" not in without_span
    assert with_span["traceparent"] == TRACEPARENT


def test_async_metadata_carries_api_key_and_traceparent(server):
    async def main():
        async with AsyncGenerationClient(server.target, api_key=API_KEY) as client:
            with _current_span():
                return await client.generate("hello world", max_tokens=2)

    completion = asyncio.run(main())
    hello, world = word_ids("hello world")
    assert completion.token_ids == [hello, world] and completion.text == f"<{hello}><{world}>"
    metadata = server.servicer.metadata[0]
    assert metadata["authorization"] == f"Bearer {API_KEY}"
    assert metadata["traceparent"] == TRACEPARENT


def test_async_stream_yields_responses_as_produced(server):
    async def main():
        async with AsyncGenerationClient(server.target, api_key=API_KEY) as client:
            return [list(r.token_ids) async for r in client.generate_stream([9, 8], max_tokens=4)]

    assert asyncio.run(main()) == [[9], [8], [9], [8]]


def test_closing_a_sync_stream_cancels_the_rpc(server):
    server.servicer.token_delay_s = 0.05
    with GenerationClient(server.target, api_key=API_KEY) as client:
        stream = client.generate_stream([1], max_tokens=1000, request_id="to-cancel")
        assert list(next(stream).token_ids) == [1]
        stream.close()
    assert server.servicer.cancelled_event.wait(5)
    assert server.servicer.cancelled == ["to-cancel"]


@pytest.mark.parametrize("how", ["task.cancel", "aclose"])
def test_cancelling_an_async_stream_cancels_the_rpc(server, how):
    server.servicer.token_delay_s = 0.05

    async def main():
        async with AsyncGenerationClient(server.target, api_key=API_KEY) as client:
            stream = client.generate_stream([1], max_tokens=1000, request_id="to-cancel")
            if how == "aclose":
                assert list((await anext(stream)).token_ids) == [1]
                await stream.aclose()
                return
            first = asyncio.Event()

            async def consume():
                async for _ in stream:
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert server.servicer.cancelled_event.wait(5)
    assert server.servicer.cancelled == ["to-cancel"]


def test_errors_carry_the_status_code(server):
    client = GenerationClient(server.target, api_key=API_KEY)
    with client, pytest.raises(GenerationError) as error:
        client.generate("fail please")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details == "prompt asked to fail"

    client = GenerationClient(server.target, api_key="wrong")
    with client, pytest.raises(GenerationError) as error:
        client.generate("hello")
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED

    async def main():
        async with AsyncGenerationClient(server.target, api_key=API_KEY) as client:
            await client.generate("fail")

    with pytest.raises(GenerationError) as error:
        asyncio.run(main())
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_unreachable_server_is_unavailable():
    client = GenerationClient("127.0.0.1:1", timeout=5)
    with client, pytest.raises(GenerationError) as error:
        client.model_info()
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_unary_calls_sync_and_async(server):
    with GenerationClient(server.target) as client:
        assert client.health() == "SERVING"
        assert client.model_info().vocab_size == 1000
        assert client.tokenize("a b") == [98, 99]

    async def main():
        async with AsyncGenerationClient(server.target) as client:
            info = await client.model_info()
            return await client.health(), info.eos_token_ids, await client.tokenize("a")

    assert asyncio.run(main()) == ("SERVING", [0], [98])


def test_build_request_leaves_unset_parameters_to_the_server():
    request = build_request([1, 2], max_tokens=3, top_p=None, stop=["\n"])
    assert list(request.token_ids.ids) == [1, 2] and request.sampling.max_tokens == 3
    assert not request.sampling.HasField("top_p") and not request.sampling.HasField("temperature")
    assert list(request.sampling.stop) == ["\n"]
    assert build_request("hi").text == "hi"
    with pytest.raises(TypeError, match="max_token"):
        build_request("hi", max_token=3)


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    generate_command.add_arguments(parser)
    return generate_command.run(parser.parse_args(argv))


def test_generate_command_streams_text_then_usage(server, capsys, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", API_KEY)
    monkeypatch.setenv("PDSERVE_TARGET", server.target)
    assert _run_cli(["a b", "--stream", "--max-tokens", "3", "--stop", "x", "--stop", "y"]) == 0
    out, err = capsys.readouterr()
    assert out == "<98><99><98>\n"
    assert "[length]" in err and "completion 3 tokens" in err
    assert list(server.servicer.requests[0].sampling.stop) == ["x", "y"]


def test_generate_command_json_and_errors(server, capsys):
    target = ["--target", server.target, "--api-key", API_KEY]
    assert _run_cli(["a", "--max-tokens", "2", "--json", *target]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == [98, 98]
    assert _run_cli(["fail", *target]) == 1
    assert capsys.readouterr().err.strip() == "error: INVALID_ARGUMENT: prompt asked to fail"


def test_a_completion_gathers_interleaved_choices_by_index():
    pb = generate_pb2
    responses = [
        pb.GenerateResponse(request_id="r", index=1, token_ids=[7], text="b", logprobs=[-0.5]),
        pb.GenerateResponse(request_id="r", index=0, token_ids=[5], text="a", logprobs=[-0.25]),
        pb.GenerateResponse(
            index=1,
            token_ids=[8],
            text="c",
            logprobs=[-1.0],
            finish_reason=pb.FINISH_REASON_STOP,
            cumulative_logprob=-1.5,
            score=-0.75,
        ),
        pb.GenerateResponse(
            index=0,
            finish_reason=pb.FINISH_REASON_LENGTH,
            cumulative_logprob=-0.25,
            usage=pb.Usage(prompt_tokens=3, completion_tokens=3),
        ),
    ]
    completion = Completion.from_responses(responses)
    first, second = completion.choices
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("a", [5], "length")
    assert (second.index, second.text, second.token_ids) == (1, "bc", [7, 8])
    assert (second.finish_reason, second.cumulative_logprob, second.score) == ("stop", -1.5, -0.75)
    assert first.cumulative_logprob == -0.25 and first.score is None
    as_json = completion.to_dict()
    assert as_json["text"] == "a" and as_json["usage"]["completion_tokens"] == 3
    assert [c["token_ids"] for c in as_json["choices"]] == [[5], [7, 8]]
    assert as_json["choices"][1]["finish_reason"] == "stop"


def test_build_request_sets_the_decoding_rules():
    request = build_request(
        "hi", n=2, beam_width=4, length_penalty=0.5, early_stopping=True, dola_layers=[0, 2]
    )
    sampling = request.sampling
    assert (sampling.n, sampling.beam_width, sampling.early_stopping) == (2, 4, True)
    assert sampling.length_penalty == 0.5
    assert list(sampling.dola_layers.indices.layers) == [0, 2]
    sled = build_request("hi", sled=True, sled_layers="high", evolution_scale=5).sampling
    assert sled.sled and sled.sled_layers.preset == "high" and sled.evolution_scale == 5
    assert not build_request("hi").sampling.HasField("dola_layers")


def test_the_speculation_opt_out_reaches_the_server(server, capsys):
    assert not build_request("hi").sampling.disable_speculation
    with GenerationClient(server.target, api_key=API_KEY) as client:
        client.generate("a", max_tokens=1, disable_speculation=True)
    target = ["--target", server.target, "--api-key", API_KEY]
    assert _run_cli(["a", "--max-tokens", "1", "--no-speculation", *target]) == 0
    assert _run_cli(["a", "--max-tokens", "1", *target]) == 0
    capsys.readouterr()
    sent = [r.sampling.disable_speculation for r in server.servicer.requests]
    assert sent == [True, True, False]


def test_generate_command_sends_the_decoding_flags(server, capsys):
    target = ["--target", server.target, "--api-key", API_KEY]
    flags = ["--n", "2", "--beam-width", "3", "--length-penalty", "0.5", "--early-stopping"]
    flags += ["--repetition-penalty", "1.2", "--dola-layers", "0,2", "--sled-layers", "low"]
    flags += ["--sled", "--evolution-rate", "1.5", "--evolution-scale", "4"]
    flags += ["--evolution-lower-bound", "-50"]
    assert _run_cli(["a", "--max-tokens", "1", "--json", *flags, *target]) == 0
    assert json.loads(capsys.readouterr().out)["choices"][0]["token_ids"] == [98]
    sampling = server.servicer.requests[0].sampling
    assert (sampling.n, sampling.beam_width, sampling.early_stopping) == (2, 3, True)
    assert list(sampling.dola_layers.indices.layers) == [0, 2]
    assert sampling.sled and sampling.sled_layers.preset == "low"
    assert (sampling.evolution_scale, sampling.evolution_lower_bound) == (4, -50.0)
    assert sampling.repetition_penalty == pytest.approx(1.2)
    with pytest.raises(SystemExit):
        _run_cli(["a", "--dola-layers", "middle", *target])
