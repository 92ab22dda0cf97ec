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
    GenerationClient,
    GenerationError,
    build_request,
)
from pdserve.commands import generate as generate_command
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
