"""Clients that go away mid-request, over both APIs, against a served system (real Ray workers,
prefill and KV push disaggregated): each cancellation is one INFO line of the router's log, no
ERROR and no traceback, and the server keeps serving with nothing left on its workers."""

from __future__ import annotations

import gc
import logging
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from pdserve.models.builtin import default_model_dir
from pdserve.pb import generate_pb2, generate_pb2_grpc
from tests.e2e.test_disaggregated_serving import VOCAB_HIGH, VOCAB_LOW, reference_outputs
from tests.openai.served import builtin_config, serve

CANCELS = 100
MODEL = default_model_dir().name
# Long prompts: the KV push is still under way when the client leaves at the first token.
MAX_TOKENS = 1400  # with the prompt, nearly the model's context: seconds of decoding
CANCELLED = "cancelled by the client"
DEADLINE_S = 1.0  # mostly past the first token, short of the last


@pytest.fixture(scope="module")
def served(ray_cluster) -> Iterator:
    config = builtin_config()
    config.engine.num_kv_blocks = 4096  # room for every concurrent request's whole context
    with serve(config) as app:
        yield app


class Records(logging.Handler):
    """Every record the router's process logs, including loggers that do not propagate to the
    root (Ray's own, which reports errors nobody retrieved)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def router_log() -> Iterator[Records]:
    handler = Records()
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.root.manager.loggerDict.values()
        if isinstance(logger, logging.Logger) and not logger.propagate
    ]
    levels = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    try:
        yield handler
    finally:
        for logger, level in levels.items():
            logger.removeHandler(handler)
            logger.setLevel(level)


def prompt_of(rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(8, 300))]


def grpc_request(prompt: list[int]) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )


def cancel_one(served, channel: grpc.Channel, i: int) -> tuple[int, int]:
    """The i-th cancellation: (1, 0) if it cancelled a request the router was running (it left
    after the first token), (0, 1) if it may have (it left at a random early moment, perhaps
    before the router saw the request), (0, 0) if the request finished first."""
    rng = random.Random(i)
    prompt = prompt_of(rng)
    kind = i % 5
    url = f"http://127.0.0.1:{served.http_port}/v1/completions"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    stub = generate_pb2_grpc.GenerationStub(channel)
    if kind == 0:  # HTTP: an SSE stream closed after its first chunk (completions or chat)
        if i % 2:
            url = url.replace("/completions", "/chat/completions")
            body["messages"] = [{"role": "user", "content": "hi"}]
            del body["prompt"]
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as response:
            assert response.status_code == 200, response.read()
            assert next(response.iter_lines()).startswith("data: {")
        return 1, 0
    if kind == 1:  # gRPC: Generate cancelled after its first response
        call = stub.Generate(grpc_request(prompt), timeout=60)
        assert next(call).token_ids
        call.cancel()
        return 1, 0
    if kind == 2:  # gRPC: the client's deadline passes mid-stream (the server cancels it)
        call = stub.Generate(grpc_request(prompt), timeout=DEADLINE_S)
        tokens = 0
        try:
            for response in call:
                tokens += len(response.token_ids)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            return (1, 0) if tokens else (0, 1)
        assert tokens == MAX_TOKENS
        return 0, 0
    if kind == 3:  # gRPC: cancelled at a random early moment (routing, prefill, KV push)
        call = stub.Generate(grpc_request(prompt), timeout=60)
        time.sleep(rng.uniform(0, 0.1))
        call.cancel()
        return 0, 1
    # HTTP: a client that gives up early (routing, prefill, KV push, decoding)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, json=body, timeout=rng.uniform(0.02, 0.2))
    return 0, 1


def used_blocks(served) -> dict[str, int]:
    import ray

    workers = served.app.pool.workers.values()
    return {w.worker_id: ray.get(w.actor.stats.remote()).num_used_blocks for w in workers}


# Aborts free blocks at once on both workers, even one that Ray runs before the reserve(),
# generate() or prefill() it aborts (tests/decode_service/test_reserve_abort.py and
# test_prefill_abort.py); the margin is for a loaded machine, well under the reservation
# timeout (20 s) that a leaked reservation would wait out.
IDLE_S = 10.0


def wait_idle(served, timeout_s: float = IDLE_S) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while any((used := used_blocks(served)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


def test_cancellations_are_one_info_line_each_and_the_server_keeps_serving(served, router_log):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        with ThreadPoolExecutor(max_workers=8) as pool:
            outcomes = list(pool.map(lambda i: cancel_one(served, channel, i), range(CANCELS)))
        assert wait_idle(served) == dict.fromkeys(served.app.pool.workers, 0)
        # Ray reports an error nobody retrieved when its reference is dropped: give it the
        # chance to before the log is read.
        gc.collect()
        time.sleep(1.0)

        # Still serving, exactly, over both APIs.
        prompt = list(range(VOCAB_LOW + 3, VOCAB_LOW + 29))
        expected = reference_outputs([prompt], [6])[0]
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=generate_pb2.SamplingParams(max_tokens=6, ignore_eos=True),
        )
        stub = generate_pb2_grpc.GenerationStub(channel)
        assert [t for r in stub.Generate(request, timeout=60) for t in r.token_ids] == expected
    response = httpx.post(
        f"http://127.0.0.1:{served.http_port}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        | {"temperature": 0, "return_token_ids": True},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == expected

    records = router_log.records
    errors = [f"{r.name}: {r.getMessage()}" for r in records if r.levelno >= logging.ERROR]
    assert not errors, errors[:3]
    tracebacks = [r for r in records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks[:3]]
    lines = [r for r in records if CANCELLED in r.getMessage()]
    assert all(r.levelno == logging.INFO for r in lines)
    running = sum(certain for certain, _ in outcomes)
    early = sum(possible for _, possible in outcomes)
    assert running >= CANCELS // 2
    assert running <= len(lines) <= running + early, (len(lines), running, early)
