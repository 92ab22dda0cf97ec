"""`pdserve serve --role-switching`: workers move between prefill and decode under load, on the
same engine (no restart), every request completing token-identical to the colocated engine,
no block leaked, the moved worker's prefix cache kept and used in its new role."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from pdserve.pb import generate_pb2_grpc
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import (
    VOCAB_HIGH,
    VOCAB_LOW,
    all_workers_idle,
    collect,
    reference_outputs,
    request,
)


@pytest.fixture(scope="module")
def served(ray_cluster):
    from pdserve.app import BackgroundApp

    config = serve_config("grpc", prefill_workers=1, decode_workers=2)
    config.router.plan_interval_s = 3600.0  # the plans here are handed in by the tests
    config.router.role_switching = True
    config.router.role_switch_dwell_s = 3600.0
    with BackgroundApp(config) as app:
        yield app


@pytest.fixture()
def stub(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        yield generate_pb2_grpc.GenerationStub(channel)


def prompts_of(seed: int, count: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(8, 48))]
        for _ in range(count)
    ]
    return prompts, [rng.randint(10, 24) for _ in prompts]


def switch_under_load(served, stub, prompts, max_tokens, worker_id, to_role):
    """Runs the requests concurrently and switches the worker while they are in flight."""
    switcher = served.app.role_switcher
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(collect, stub, request(p, n))
            for p, n in zip(prompts, max_tokens, strict=True)
        ]
        deadline = time.monotonic() + 30
        while served.app.pool.workers[worker_id].inflight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert served.app.pool.workers[worker_id].inflight > 0, "no load on the worker to drain"
        (switch,) = served.run(switcher.switch(to_role, worker_id), timeout=120)
        answers = [f.result() for f in futures]
    return switch, answers


def routes(answers) -> list[tuple[str, str]]:
    return [(r[-1].timings.prefill_worker, r[-1].timings.decode_worker) for _, r in answers]


def test_workers_switch_roles_under_load_and_every_request_matches(served, stub):
    pool = served.app.pool
    # 1P:2D -> 2P:1D: decode-1 drains its running sequences, then prefills.
    prompts, max_tokens = prompts_of(1, 16)
    switch, answers = switch_under_load(served, stub, prompts, max_tokens, "decode-1", "prefill")
    assert [tokens for tokens, _ in answers] == reference_outputs(prompts, max_tokens)
    assert (switch.from_role, switch.to_role) == ("decode", "prefill")
    assert switch.still_running == 0 and switch.drain_s < 30
    assert switch.blocks_kept > 0  # the KV it received stays in its prefix cache
    assert [w.worker_id for w in pool.of_role("prefill")] == ["prefill-0", "decode-1"]
    assert ray.get(pool.workers["decode-1"].actor.stats.remote()).role == "prefill"

    # 2P:1D -> 1P:2D the other way: prefill-0 finishes its queue and pushes, then decodes.
    prompts2, max_tokens2 = prompts_of(2, 16)
    switch2, answers2 = switch_under_load(
        served, stub, prompts2, max_tokens2, "prefill-0", "decode"
    )
    assert [tokens for tokens, _ in answers2] == reference_outputs(prompts2, max_tokens2)
    assert switch2.still_running == 0

    # Now decode-1 is the only prefill worker (disaggregate=always) and prefill-0 decodes. The
    # first batch's prompts, sent again, hit the cache decode-1 kept from its decode role.
    before = ray.get(pool.workers["decode-1"].actor.stats.remote()).prefix_hit_tokens
    answers3 = [
        collect(stub, request(p, n)) for p, n in zip(prompts[:6], max_tokens[:6], strict=True)
    ]
    assert [tokens for tokens, _ in answers3] == reference_outputs(prompts[:6], max_tokens[:6])
    assert {p for p, _ in routes(answers3)} == {"decode-1"}
    after = ray.get(pool.workers["decode-1"].actor.stats.remote()).prefix_hit_tokens
    assert after > before, "the switched worker lost the prefix cache of its decode role"
    both = run_batch(stub, *prompts_of(3, 12))
    assert "prefill-0" in {d for _, d in routes(both)}
    assert all_workers_idle(served) == dict.fromkeys(pool.workers, 0)


def run_batch(stub, prompts, max_tokens):
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        answers = list(
            pool.map(lambda pn: collect(stub, request(*pn)), zip(prompts, max_tokens, strict=True))
        )
    assert [tokens for tokens, _ in answers] == reference_outputs(prompts, max_tokens)
    return answers


def plan(prefill: int, decode: int, gain: float) -> dict:
    """An online plan recommending prefill:decode at `gain` x the other split's goodput."""
    name = f"{prefill}P:{decode}D"
    other = f"{decode}P:{prefill}D"
    return {
        "workers": prefill + decode,
        "recommended": name,
        "prefill_workers": prefill,
        "decode_workers": decode,
        "goodput_rps": 10.0 * gain,
        "splits": [
            {"split": name, "goodput_rps": 10.0 * gain, "pruned": False},
            {"split": other, "goodput_rps": 10.0, "pruned": False},
        ],
    }


def current_split(pool) -> tuple[int, int]:
    return len(pool.of_role("prefill")), len(pool.of_role("decode"))


def test_an_oscillating_plan_switches_once_per_dwell_never_back(served):
    """The planner's signal flips between the two splits at every plan, each far beyond the
    margin: the first flip is acted on, then the dwell (an hour here) holds the worker."""
    switcher, pool = served.app.role_switcher, served.app.pool
    switcher.hysteresis.last_switch_at = float("-inf")
    done_before = len(switcher.switches)
    start = current_split(pool)
    held = []
    for _ in range(8):
        prefill, decode = current_split(pool)
        flipped = plan(decode, prefill, 2.0)  # the other split, twice the goodput
        served.run(_call(lambda answer=flipped: switcher.on_plan(answer)))
        deadline = time.monotonic() + 60
        while switcher._tasks and time.monotonic() < deadline:  # a started switch completes
            time.sleep(0.05)
        held.append(switcher.hysteresis.held_because)
    assert len(switcher.switches) == done_before + 1
    assert current_split(pool) == (start[1], start[0])
    assert held[0] == "" and all("dwell" in why for why in held[1:]), held
    assert all_workers_idle(served) == dict.fromkeys(pool.workers, 0)


async def _call(function):
    return function()


def test_a_small_gain_is_no_reason_to_switch(served):
    switcher, pool = served.app.role_switcher, served.app.pool
    switcher.hysteresis.last_switch_at = float("-inf")
    done_before = len(switcher.switches)
    prefill, decode = current_split(pool)
    served.run(_call(lambda: switcher.on_plan(plan(decode, prefill, 1.05))))
    assert not switcher._tasks and len(switcher.switches) == done_before
    assert "does not beat" in switcher.hysteresis.held_because


def test_a_switched_worker_that_restarts_is_told_its_role_again(served, stub):
    pool = served.app.pool
    moved = next(w for w in pool.workers.values() if not w.worker_id.startswith(w.role))
    old_epoch = moved.epoch

    ray.kill(moved.actor, no_restart=False)  # Ray restarts it in the role it was created with

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (moved.healthy and moved.epoch != old_epoch):
        time.sleep(0.2)
    assert moved.epoch != old_epoch
    while time.monotonic() < deadline and moved.stats.role != moved.role:
        time.sleep(0.2)
    assert moved.stats.role == moved.role  # the router's role, not its pool's
    run_batch(stub, *prompts_of(4, 8))
