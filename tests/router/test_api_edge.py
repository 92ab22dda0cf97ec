"""The client API edge over real gRPC: API keys, undecodable requests, sizes, draining."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.client import GenerationClient, GenerationError
from pdserve.pb import generate_pb2, generate_pb2_grpc
from tests.router.api_server import ApiServer, model_limits

GENERATE = "/pdserve.v1.Generation/Generate"
TOKENIZE = "/pdserve.v1.Generation/Tokenize"
# About two million bytes: seconds of tokenizing on one core.
LONG_TEXT = "lorem ipsum dolor sit amet, 12345. " * 60_000
RECEIVE_ANY = ("grpc.max_receive_message_length", -1)


def _list_services(channel: grpc.Channel, metadata=()) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    response = next(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10))
    return {s.name for s in response.list_services_response.service}


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def test_every_api_rpc_but_health_needs_a_key(tmp_path):
    with ApiServer(tmp_path, api_keys=["key-1", "key-2"]) as server:
        with grpc.insecure_channel(server.target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            info = generate_pb2.GetModelInfoRequest()
            assert _code(lambda: stub.GetModelInfo(info, timeout=10)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            assert _code(lambda: _list_services(channel)) == grpc.StatusCode.UNAUTHENTICATED
            tokenize = generate_pb2.TokenizeRequest(text="hi")
            assert _code(lambda: stub.Tokenize(tokenize, timeout=10)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            wrong = [("authorization", "Bearer key-3")]
            assert _code(lambda: stub.GetModelInfo(info, metadata=wrong, timeout=10)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            # The scheme is case-insensitive (RFC 9110); the key is not.
            for scheme in ("Bearer", "bearer", "BEARER"):
                key = [("authorization", f"{scheme} key-2")]
                assert stub.GetModelInfo(info, metadata=key, timeout=10).name == "tiny"
                assert "pdserve.v1.Generation" in _list_services(channel, key)
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        with GenerationClient(server.target, api_key="key-1", timeout=10) as client:
            assert client.tokenize("hello")


def test_undecodable_requests_are_invalid_argument_and_log_no_error(tmp_path, caplog):
    bad_utf8 = b"\x1a\x02\xff\xfe"  # field 3 (prompt.text): two bytes that are not UTF-8
    truncated = b"\x1a\x10abc"  # field 3 claims 16 bytes, 3 follow
    with ApiServer(tmp_path) as server, grpc.insecure_channel(server.target) as channel:
        with caplog.at_level(logging.WARNING):
            for raw in (bad_utf8, truncated):
                stream = channel.unary_stream(GENERATE)(raw, timeout=10)
                with pytest.raises(grpc.RpcError) as error:
                    list(stream)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "pdserve.v1.GenerateRequest" in error.value.details()
            with pytest.raises(grpc.RpcError) as error:
                channel.unary_unary(TOKENIZE)(b"\x12\x01\xff", timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "pdserve.v1.TokenizeRequest" in error.value.details()
            # The server keeps serving.
            stub = generate_pb2_grpc.GenerationStub(channel)
            assert stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10).name
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_text_over_the_byte_limit_is_refused_and_larger_messages_never_arrive(tmp_path):
    limits = model_limits(max_prompt_bytes=10_000)
    with (
        ApiServer(tmp_path, limits=limits) as server,
        GenerationClient(server.target, timeout=10) as client,
    ):
        with pytest.raises(GenerationError) as error:
            client.tokenize("x" * 10_001)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details == "text: 10001 bytes exceed the limit of 10000 bytes"
        with pytest.raises(GenerationError) as error:
            client.generate("x" * 10_001, max_tokens=2)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details.startswith("prompt.text: 10001 bytes")
        # Past the receive limit gRPC refuses the message before anything decodes it.
        with pytest.raises(GenerationError) as error:
            client.tokenize("x" * (1 << 20))
        assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_health_answers_while_a_long_prompt_is_tokenized(tmp_path):
    with ApiServer(tmp_path) as server, GenerationClient(server.target, timeout=60) as client:
        tokenized = threading.Event()
        worker = threading.Thread(
            target=lambda: (client.tokenize(LONG_TEXT), tokenized.set()), daemon=True
        )
        worker.start()
        time.sleep(0.7)  # the text has arrived and is being tokenized
        started = time.perf_counter()
        assert client.health() == "SERVING"
        latency = time.perf_counter() - started
        answered_first = not tokenized.is_set()
        worker.join(60)
    assert tokenized.is_set()
    assert answered_first, "tokenizing finished before health answered: the text is too short"
    assert latency < 0.25


def _signal_when_tokenizing(server: ApiServer) -> threading.Event:
    """An event set when the server's Tokenize servicer starts encoding a request."""
    started = threading.Event()
    tokenizer = server.service._tokenizer
    encode = tokenizer.encode

    async def encode_and_signal(*args, **kwargs):
        started.set()
        return await encode(*args, **kwargs)

    tokenizer.encode = encode_and_signal
    return started


def _first_refusal(target: str, timeout_s: float) -> GenerationError:
    """The error of the first new RPC refused by a server that is starting to stop (the stop
    thread may not have run yet on a loaded machine: the RPCs before it succeed)."""
    deadline = time.monotonic() + timeout_s
    with GenerationClient(target, timeout=10) as late:
        while time.monotonic() < deadline:
            try:
                late.model_info()
            except GenerationError as error:
                # A call that reaches gRPC's core in the instant its shutdown begins is
                # cancelled there, not refused; the calls after it are refused.
                if error.code != grpc.StatusCode.CANCELLED:
                    return error
            time.sleep(0.05)
    raise AssertionError(f"the server took new RPCs for {timeout_s} s after its stop began")


def test_stop_refuses_new_rpcs_and_lets_running_ones_finish(tmp_path):
    with (
        ApiServer(tmp_path, shutdown_grace_s=60) as server,
        GenerationClient(server.target, timeout=60) as client,
    ):
        tokenizing = _signal_when_tokenizing(server)
        results: list = []
        worker = threading.Thread(
            target=lambda: results.append(client.tokenize(LONG_TEXT)), daemon=True
        )
        worker.start()
        # On a loaded machine the RPC can take longer than any fixed sleep to reach the
        # server, and a stop that begins first refuses it; so wait for the servicer to run.
        assert tokenizing.wait(30)
        stopping = threading.Thread(target=server.stop, daemon=True)
        stopping.start()
        refused = _first_refusal(server.target, timeout_s=30)
        worker.join(60)
        stopping.join(60)
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert results and len(results[0]) > 100_000


def test_health_stays_fast_for_the_whole_of_a_4_mib_tokenize(tmp_path):
    """Issue 46, N8: the response's token strings (millions) are made and serialized off the
    event loop. A stall the code causes comes back at every call; a busy host's scheduling
    hiccup does not: the slowest health answer of the best of three calls is the measure. Built
    on the loop, the strings stalled it 3.5-6.4 s; off it, a loaded 2-core CI machine still saw
    0.15 s (the tokenizer thread holds the interpreter lock in turns), so 0.5 s tells them apart."""
    text = ("0123456789" * (1 << 19))[: 4 << 20]  # at the byte cap
    request = generate_pb2.TokenizeRequest(text=text)
    slowest = []
    # The router freezes its start-up heap out of the collector's full passes
    # (pdserve/heap.py); this server shares the test process, whose heap after a whole suite
    # makes each full pass triggered by millions of new strings take ~0.16 s. Frozen the same.
    with (
        _heap_frozen(),
        ApiServer(tmp_path) as server,
        grpc.insecure_channel(server.target, options=[RECEIVE_ANY]) as channel,
    ):
        # The answer stays bytes until the end: the server shares this process, and decoding
        # millions of strings here would hold the interpreter's lock against it.
        tokenize = channel.unary_unary(
            "/pdserve.v1.Generation/Tokenize",
            request_serializer=generate_pb2.TokenizeRequest.SerializeToString,
        )
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(3):
            answer: list = []
            call = lambda into=answer: into.append(tokenize(request, timeout=300))  # noqa: E731
            worker = threading.Thread(target=call)
            worker.start()
            latencies = []
            while worker.is_alive():
                started = time.perf_counter()
                health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                latencies.append(time.perf_counter() - started)
                time.sleep(0.01)
            worker.join()
            response = generate_pb2.TokenizeResponse.FromString(answer[0])
            assert len(response.tokens) == len(response.token_ids) > 500_000
            assert len(latencies) > 50
            slowest.append(max(latencies))
    assert min(slowest) <= 0.5, slowest


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _closed_within(sock, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass  # reset: closed
    return True


def test_silent_and_idle_connections_are_closed(tmp_path):
    """A connection that never completes its handshake, and one that completes it but runs no
    RPC, are closed at their deadlines (not held open forever, as slowloris would have it)."""
    import socket

    with ApiServer(tmp_path, handshake_timeout_ms=1000, max_connection_idle_ms=1500) as server:
        host, port = server.target.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as silent:
            started = time.monotonic()
            assert _closed_within(silent, 15)
            assert time.monotonic() - started < 10
        with grpc.insecure_channel(server.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            state = []
            channel.subscribe(state.append)
            time.sleep(4)  # idle past 1.5 s: the server sent GOAWAY, the channel went idle
            assert grpc.ChannelConnectivity.IDLE in state[1:], state
