"""Chaos: workers and Redis are killed (SIGKILL) or frozen (SIGSTOP) while greedy load runs.

2 prefill + 2 decode workers, over each KV transport. Every request must either complete with
exactly the output of an uninterrupted run (the engine in this process), or end with a clear
status from the server before the client's deadline: the tokens it got are then a prefix of
that output. Afterwards, with every victim restarted or thawed, no worker holds a block,
reservation or transfer, and the system serves exact output again.

Victims are drawn from a seeded RNG; the seed is printed (set PDSERVE_CHAOS_SEED to replay).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import pytest

from pdserve.bench.common.system_probe import redis_pid, settled_leftovers, worker_pids
from pdserve.pb import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import VOCAB_HIGH, VOCAB_LOW, reference_outputs

SEED = int(os.environ.get("PDSERVE_CHAOS_SEED", random.randrange(2**32)))
NUM_REQUESTS = 8
MAX_TOKENS = 24
DEADLINE_S = 45.0  # the client's deadline per request; the server must answer before it
# Clear answers from the server; DEADLINE_EXCEEDED is the client giving up: not one of them.
CLEAR_STATUSES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}
PROGRESS_TIMEOUT_S = 2.0
FAILOVER_S = 15.0  # far longer than the progress timeout: a frozen worker must be left


@contextmanager
def chaos_app(config) -> Iterator:
    """`config` served for chaos: the seed printed, a frozen worker left after
    PROGRESS_TIMEOUT_S (one request may meet two frozen workers in turn, and still ends while
    they are frozen)."""
    from pdserve.app import BackgroundApp

    print(f"chaos seed {SEED} (PDSERVE_CHAOS_SEED={SEED} replays it)")
    config.router.progress_timeout_s = PROGRESS_TIMEOUT_S
    with BackgroundApp(config) as app:
        yield app


@pytest.fixture(scope="module", params=["grpc", "collective"])
def served(request, ray_cluster) -> Iterator:
    with chaos_app(serve_config(request.param)) as app:
        yield app


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    seconds: float = 0.0


def run_load(
    served, prompts: list[list[int]], chaos: Callable[[], None], started_fraction: float = 0.5
) -> list[Outcome]:
    """Sends every prompt at once; runs `chaos` once that fraction of them has streamed tokens."""
    outcomes = [Outcome() for _ in prompts]
    streaming = threading.Semaphore(0)

    def one(i: int) -> None:
        outcome, begun = outcomes[i], time.monotonic()
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompts[i]),
            sampling=generate_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            try:
                for response in stub.Generate(request, timeout=DEADLINE_S):
                    if not outcome.tokens and response.token_ids:
                        streaming.release()
                    outcome.tokens += response.token_ids
            except grpc.RpcError as error:
                outcome.code, outcome.details = error.code(), error.details() or ""
            finally:
                outcome.seconds = time.monotonic() - begun
                if not outcome.tokens:
                    streaming.release()  # never streamed: do not hold the chaos back

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        for _ in range(max(1, int(len(prompts) * started_fraction))):
            streaming.acquire(timeout=DEADLINE_S)
        chaos()
        for future in futures:
            future.result()
    return outcomes


def assert_exact_or_clear(outcomes: list[Outcome], expected: list[list[int]]) -> None:
    for i, (outcome, want) in enumerate(zip(outcomes, expected, strict=True)):
        where = f"request {i}, seed {SEED}: {outcome.code.name} {outcome.details!r}"
        if outcome.code == grpc.StatusCode.OK:
            assert outcome.tokens == want, where
        else:
            assert outcome.code in CLEAR_STATUSES, where
            assert outcome.details, where
            assert outcome.tokens == want[: len(outcome.tokens)], where
        assert outcome.seconds < DEADLINE_S, where


def random_prompts(rng: random.Random) -> list[list[int]]:
    return [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(8, 60))]
        for _ in range(NUM_REQUESTS)
    ]


def one_of_each_role(served, rng: random.Random) -> list[str]:
    pool = served.app.pool
    return [
        rng.choice(sorted(w.worker_id for w in pool.of_role(role)))
        for role in ("prefill", "decode")
    ]


def wait_all_healthy(served, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    workers = served.app.pool.workers
    while not all(w.healthy for w in workers.values()):
        assert time.monotonic() < deadline, {w: workers[w].healthy for w in workers}
        time.sleep(0.2)


def assert_recovered_clean_and_exact(served, rng: random.Random) -> None:
    wait_all_healthy(served)
    left = settled_leftovers(served.app, timeout_s=30.0)
    assert all(w.clean for w in left.values()), (SEED, left)
    prompts = random_prompts(rng)
    outcomes = run_load(served, prompts, chaos=lambda: None)
    assert [o.tokens for o in outcomes] == reference_outputs(prompts, [MAX_TOKENS] * len(prompts))


def test_killed_workers_and_redis(served, rng):
    prompts = random_prompts(rng)
    expected = reference_outputs(prompts, [MAX_TOKENS] * len(prompts))
    victims = one_of_each_role(served, rng)
    pids = worker_pids(served.app)
    killed = [pids[v] for v in victims] + [redis_pid(served.app)]
    print(f"seed {SEED}: SIGKILL {victims} and redis (pids {killed})")

    def chaos() -> None:
        for pid in killed:
            os.kill(pid, signal.SIGKILL)

    outcomes = run_load(served, prompts, chaos)
    assert_exact_or_clear(outcomes, expected)
    assert_recovered_clean_and_exact(served, rng)
    assert all(worker_pids(served.app)[v] != pids[v] for v in victims)  # Ray restarted them


def test_redis_is_restarted_and_the_index_recovers(served, rng):
    server, index = served.app.redis_server, served.app.routing.index
    old_pid = redis_pid(served.app)
    os.kill(old_pid, signal.SIGKILL)
    prompt = random_prompts(rng)[0]
    expected = reference_outputs([prompt], [MAX_TOKENS])
    deadline = time.monotonic() + 20.0
    # Requests keep completing; their routing lookups notice the outage and the recovery.
    while not (server.running and redis_pid(served.app) != old_pid and index.available):
        assert time.monotonic() < deadline, "redis-server was not restarted"
        outcomes = run_load(served, [prompt], chaos=lambda: None)
        assert [o.tokens for o in outcomes] == expected, [(o.code, o.details) for o in outcomes]
        time.sleep(0.2)
    assert_recovered_clean_and_exact(served, rng)


def test_frozen_workers_and_redis(served, rng):
    prompts = random_prompts(rng)
    expected = reference_outputs(prompts, [MAX_TOKENS] * len(prompts))
    victims = one_of_each_role(served, rng)
    pids = worker_pids(served.app)
    frozen = [pids[v] for v in victims] + [redis_pid(served.app)]
    print(f"seed {SEED}: SIGSTOP {victims} and redis (pids {frozen}) until the load ends")

    def chaos() -> None:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)

    # Thawed only once every request has ended: each one ended while its victims were frozen,
    # so none of them waited for a frozen worker to come back.
    try:
        outcomes = run_load(served, prompts, chaos)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)  # a no-op for a process the load never froze
    assert_exact_or_clear(outcomes, expected)
    # One worker of each role stayed up: a frozen one is failed over, not waited for.
    summary = [(o.code.name, round(o.seconds, 1), len(o.tokens)) for o in outcomes]
    assert all(o.code == grpc.StatusCode.OK for o in outcomes), (SEED, summary)
    assert max(o.seconds for o in outcomes) < FAILOVER_S, (SEED, summary)
    assert_recovered_clean_and_exact(served, rng)


def test_a_frozen_redis_stalls_no_stream(served, rng):
    """The router asks Redis off its event loop: while redis-server is frozen, requests that
    arrive wait for their own lookups (a socket timeout per backoff period, then load alone),
    and a stream already running keeps its pace."""
    # A lookup on the event loop would hold every stream for its 0.3 s socket timeout in every
    # freeze (measured: 0.03 s at most here, 0.31-0.34 s with the lookup on the loop). One
    # pause of 0.51 s came once in CI, with both cores shared by two test processes and their
    # Ray clusters, and not in six runs alone or beside three busy processes: so a second
    # freeze judges again a first that paused, which the fault fails each time and a stall of
    # the machine does not.
    during = _gaps_while_redis_is_frozen(served, rng)
    if max(during) >= 0.25:
        during = _gaps_while_redis_is_frozen(served, rng)
    assert max(during) < 0.25, sorted(during)[-5:]


def _gaps_while_redis_is_frozen(served, rng) -> list[float]:
    """The gaps between a running stream's responses while redis-server is frozen and four
    more requests arrive (each of which must end OK)."""
    long_tokens, gaps, streaming = 600, [], threading.Event()

    def stream() -> None:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=random_prompts(rng)[0]),
            sampling=generate_pb2.SamplingParams(max_tokens=long_tokens, ignore_eos=True),
        )
        with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            last = None
            for _ in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60):
                now = time.monotonic()
                if last is not None:
                    gaps.append((now, now - last))
                last = now
                streaming.set()

    runner = threading.Thread(target=stream)
    runner.start()
    assert streaming.wait(DEADLINE_S)
    pid = redis_pid(served.app)
    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        outcomes = run_load(served, random_prompts(rng)[:4], chaos=lambda: None)
    finally:
        os.kill(pid, signal.SIGCONT)
        thawed_at = time.monotonic()
    runner.join()
    assert all(o.code == grpc.StatusCode.OK for o in outcomes), [o.details for o in outcomes]
    during = [gap for at, gap in gaps if frozen_at < at <= thawed_at]
    assert len(gaps) + 1 >= long_tokens // 8 and during, (len(gaps), thawed_at - frozen_at)
    return during
