"""Routing (router/routing.py): what the router credits each worker with between polls."""

from __future__ import annotations

import math

from pdserve.config import RouterConfig
from pdserve.core.messages import PrefillResult, WorkerStats
from router.estimates import WorkerLoad
from router.policy import RoutingPolicy
from router.routing import Routing
from router.worker_pool import WorkerPool

BLOCK = 16
SYSTEM = list(range(1, 257))  # a 256-token system prompt: 16 full blocks


def routing(
    decode_caches_received_kv: bool = True, index=None, block_size: int = BLOCK, **config
) -> Routing:
    """One idle prefill and one idle decode worker; `index`: a PrefixIndex to look prompts up."""
    config.setdefault("disaggregate", "always")
    pool = WorkerPool({"prefill-0": None}, {"decode-0": None})  # no actor is ever called
    for worker in pool.workers.values():
        worker.healthy = True
        worker.stats = WorkerStats(
            worker.worker_id, worker.role, epoch=1, num_blocks=4096, num_free_blocks=4096,
            bytes_per_block=8192,
        )  # fmt: skip
    policy = RoutingPolicy(RouterConfig(**config))
    return Routing(
        pool, policy, block_size, index, decode_caches_received_kv=decode_caches_received_kv
    )


def done(route, prompt: list[int], cached: int = 0) -> PrefillResult:
    return PrefillResult(
        request_id="r", worker_id=route.prefill_worker, first_token_id=1, first_logprob=None,
        finished=False, finish_reason=None, num_prompt_tokens=len(prompt),
        num_cached_tokens=cached, queue_s=0.0, prefill_s=0.05,
    )  # fmt: skip


def test_a_decode_worker_is_credited_with_a_pushed_prefix_only_once_it_commits() -> None:
    # Until the push commits, the decode worker has none of the prompt's blocks: crediting it
    # at routing time would make a local prefill there look nearly free while it computes the
    # whole prompt.
    r = routing()
    first = SYSTEM + [1000, 1001, 1002]
    route = r.choose(first, 8, set())
    assert (route.prefill_worker, route.decode_worker) == ("prefill-0", "decode-0")
    second = r.choose(SYSTEM + [2000, 2001], 8, set())
    assert second.cached_blocks == {"prefill-0": 16}
    r.on_prefill_done(route, done(route, first))
    third = r.choose(SYSTEM + [3000], 8, set())
    assert third.cached_blocks == {"prefill-0": 16, "decode-0": 16}


def test_a_decode_worker_that_keeps_no_received_kv_is_never_credited_with_a_push() -> None:
    # Without mutual TLS or --kv-trust-peer-cache, pushed KV serves only its own request.
    r = routing(decode_caches_received_kv=False)
    first = SYSTEM + [1000, 1001, 1002]
    route = r.choose(first, 8, set())
    r.on_prefill_done(route, done(route, first))
    assert r.choose(SYSTEM + [3000], 8, set()).cached_blocks == {"prefill-0": 16}


def test_a_local_prefill_credits_its_decode_worker_at_once() -> None:
    # A request queued behind it on the same worker reuses the prefix (the scheduler computes
    # a shared prefix once), so the credit is immediate.
    r = routing(disaggregate="never")
    route = r.choose(SYSTEM + [1000], 8, set())
    assert route.prefill_worker is None
    assert r.choose(SYSTEM + [2000], 8, set()).cached_blocks == {"decode-0": 16}


def test_a_finished_requests_output_blocks_are_credited_to_its_decode_worker() -> None:
    # A conversation's next turn starts with the previous prompt and output: sent at once, it
    # must find the worker that computed them before that worker's KV events reach the index.
    r = routing()
    prompt = SYSTEM + [1000, 1001, 1002]
    route = r.choose(prompt, 40, set())
    r.on_prefill_done(route, done(route, prompt))
    output = list(range(5000, 5033))  # 33 tokens: the last one's KV is never computed
    r.on_output_computed(route, prompt + output[:-1])
    next_turn = prompt + output + [7000] * 20
    # (259 + 32) // 16 = 18 full blocks computed there; the prefill worker has the prompt's 16.
    assert r.choose(next_turn, 8, set()).cached_blocks == {"prefill-0": 16, "decode-0": 18}


def test_a_decode_worker_that_keeps_no_received_kv_is_not_credited_with_its_output() -> None:
    r = routing(decode_caches_received_kv=False)
    prompt = SYSTEM + [1000]
    route = r.choose(prompt, 40, set())
    r.on_output_computed(route, prompt + list(range(5000, 5040)))
    assert r.choose(prompt + list(range(5000, 5041)), 8, set()).cached_blocks == {"prefill-0": 16}


def test_only_a_prefill_that_had_its_worker_to_itself_is_a_cost_sample() -> None:
    # Two prompts admitted together share engine steps: each one's prefill_s includes the
    # other's work (its queue_s stays 0), which the cost model would learn as compute.
    r = routing()
    samples = []
    r.policy.cost.observe_request_prefill = lambda tokens, s, **_: samples.append((tokens, s))
    prompt = SYSTEM + [1000]
    alone = r.choose(prompt, 8, set())
    r.on_prefill_done(alone, done(alone, prompt))
    assert samples == [(len(prompt), 0.05)]
    first = r.choose(list(range(500, 600)), 8, set())  # idle worker, but another one follows
    second = r.choose(list(range(700, 800)), 8, set())  # routed while the first one runs
    r.on_prefill_done(first, done(first, list(range(500, 600))))
    r.on_prefill_done(second, done(second, list(range(700, 800))))
    assert len(samples) == 1


def test_what_was_routed_after_a_poll_was_sent_stays_counted_at_its_answer() -> None:
    # A poll sent during an engine step is answered at the step's end, before the adds queued
    # behind it: a request routed after the poll was sent is not in that snapshot.
    now = [0.0]
    r = routing()
    r.clock = lambda: now[0]
    prefill = r.pool.workers["prefill-0"]
    now[0] = 1.0
    r.choose(list(range(500, 600)), 8, set())  # before the poll: in its snapshot
    now[0] = 2.0
    sent_at = now[0]  # the poll is sent
    now[0] = 3.0
    r.choose(list(range(700, 780)), 8, set())  # routed while the poll waits for the step
    r.pool.record_stats(prefill, prefill.stats, sent_at)
    load = r._load(prefill)
    assert (load.inflight, load.inflight_prompt_tokens) == (1, 80)
    r.pool.record_stats(prefill, prefill.stats, now[0])  # the next poll, sent after it
    assert r._load(prefill).inflight == 0
    r.choose(list(range(900, 950)), 8, set())
    r.pool.record_stats(prefill, prefill.stats)  # a poll of unknown sending: all included
    assert r._load(prefill).inflight == 0


def test_a_computed_prompt_stops_counting_as_queued_before_the_next_poll() -> None:
    # Polls come every quarter second or so; a short prefill ends well before. Counting its
    # prompt as queued until then made an idle prefill worker look busy, and the policy chose
    # local prefills it did not need (bench sim-routing-offline: 40% -> 15% of requests).
    r = routing()
    prefill, decode = r.pool.workers["prefill-0"], r.pool.workers["decode-0"]
    prompt = list(range(500, 600))
    remote = r.choose(prompt, 8, set())
    assert (r._load(prefill).inflight, r._load(prefill).inflight_prompt_tokens) == (1, 100)
    r.on_prompt_computed(remote)  # its first answer, before the push
    assert (r._load(prefill).inflight, r._load(prefill).inflight_prompt_tokens) == (0, 0)
    r.on_prefill_done(remote, done(remote, prompt))  # once pushed: nothing more to take back
    assert (r._load(prefill).inflight, r._load(prefill).inflight_prompt_tokens) == (0, 0)
    assert r._load(decode).inflight == 1  # it decodes there now; the next poll shows it
    # Its KV blocks (prompt and output) count on the decode worker until a poll shows them;
    # on the prefill worker they are its cache, which its snapshot counts as free.
    blocks = math.ceil(len(prompt) / BLOCK) + math.ceil(8 / BLOCK)
    assert (r._load(decode).inflight_blocks, r._load(prefill).inflight_blocks) == (blocks, 0)

    r = routing(disaggregate="never")
    decode = r.pool.workers["decode-0"]
    local = r.choose(prompt, 8, set())
    r.on_prefill_done(local, done(local, prompt))
    # A local prefill stays to decode: its request counts until a poll shows it, not its prompt.
    assert (r._load(decode).inflight, r._load(decode).inflight_prompt_tokens) == (1, 0)
    assert r._load(decode).inflight_blocks == blocks  # computed, and held there
    r.pool.record_stats(decode, decode.stats)  # a poll that shows it
    r.on_prefill_done(local, done(local, prompt))  # already dropped: nothing to take back
    assert (r._load(decode).inflight, r._load(decode).inflight_prompt_tokens) == (0, 0)
    assert r._load(decode).inflight_blocks == 0


def test_the_blocks_routed_within_seconds_count_from_the_next_poll() -> None:
    # WorkerLoad.recent_blocks: the prefixes a worker's requests are using, counted as reused
    # cache once a poll shows them (until then the routed blocks are `inflight_blocks`).
    r = routing(disaggregate="never")
    decode = r.pool.workers["decode-0"]
    shared = list(range(1000, 1064))  # 4 full blocks every prompt below shares
    r.choose(shared + list(range(64)), 8, set())
    r.choose(shared + list(range(100, 164)), 8, set())
    assert r._load(decode).recent_blocks == 0
    r.pool.record_stats(decode, decode.stats)
    assert r._load(decode).recent_blocks == 4 + 4 + 4  # the shared prefix once, two tails
    # A prefill-only worker holds no request's KV: nothing to count (nor to scan) there.
    r = routing(disaggregate="always")
    prefill = r.pool.workers["prefill-0"]
    r.choose(shared + list(range(64)), 8, set())
    r.pool.record_stats(prefill, prefill.stats)
    assert r.recent.remembered_blocks("prefill-0") == 8
    assert r._load(prefill).recent_blocks == 0


def test_a_workers_load_follows_its_stats_health_and_routes() -> None:
    # Routing reuses a worker's WorkerLoad while nothing it is made of changed: each of a new
    # snapshot, a health change and a route must show at the next decision.
    r = routing(disaggregate="never")
    decode = r.pool.workers["decode-0"]
    assert r._load(decode) is r._load(decode)  # nothing changed: the same one
    r.pool.record_stats(decode, WorkerStats("decode-0", "decode", epoch=1, num_waiting=3))
    assert r._load(decode).num_waiting == 3
    r.pool.mark_unhealthy("decode-0", "test")
    assert not r._load(decode).healthy
    with_stats = WorkerStats("decode-0", "decode", epoch=1, num_blocks=64, num_free_blocks=64)
    r.pool.record_stats(decode, with_stats, sent_at=None)
    assert r._load(decode).healthy and r._load(decode).num_free_blocks == 64
    r.choose(SYSTEM, 8, set())
    assert (r._load(decode).inflight, r._load(decode).inflight_prompt_tokens) == (1, len(SYSTEM))


def test_a_polled_workers_load_is_made_at_the_answer_not_by_the_next_decision(
    monkeypatch,
) -> None:
    # After a round of polls the next decision would make every worker's load while its
    # request waits (~1.8 ms at 256 workers): each load is made as its answer arrives instead,
    # and a decision remakes only the loads of the workers it routes to.
    r = routing(disaggregate="auto")
    made: list[str] = []
    from_stats = WorkerLoad.from_stats

    def counted(stats, **kwargs):
        made.append(stats.worker_id)
        return from_stats(stats, **kwargs)

    monkeypatch.setattr(WorkerLoad, "from_stats", counted)
    for worker in r.pool.workers.values():
        r.pool.record_stats(worker, WorkerStats(worker.worker_id, worker.role, epoch=1,
                                                num_blocks=4096, num_free_blocks=4096,
                                                num_waiting=2))  # fmt: skip
    assert sorted(made) == ["decode-0", "prefill-0"]
    for _ in range(2):
        made.clear()
        route = r.choose(SYSTEM, 8, set())
        # Only the loads this route changed are made again, as it is routed.
        assert sorted(made) == sorted(
            {route.decode_worker, route.prefill_worker or route.decode_worker}
        )
    assert r._load(r.pool.workers["decode-0"]).num_waiting == 2


def test_each_workers_row_is_its_load_after_polls_routes_failures_and_retries() -> None:
    # A decision reads each role's LoadRows as they are: every change of a worker's load must
    # have replaced its row (router/load_rows.py).
    prefill, decode = ["prefill-0", "prefill-1"], ["decode-0", "decode-1", "decode-2"]
    pool = WorkerPool(dict.fromkeys(prefill), dict.fromkeys(decode))  # no actor is ever called
    r = Routing(pool, RoutingPolicy(RouterConfig(disaggregate="auto")), BLOCK)

    def poll(worker, waiting: int) -> None:
        stats = WorkerStats(worker.worker_id, worker.role, epoch=1, num_waiting=waiting,
                            waiting_prompt_tokens=100 * waiting, num_running=waiting + 1,
                            num_blocks=4096, num_free_blocks=4000 - waiting)  # fmt: skip
        pool.record_stats(worker, stats, sent_at=r.clock())

    def rows_are_loads() -> None:
        for role, rows in r._rows.items():
            expected = []
            for worker in pool.of_role(role, healthy_only=False):
                routed = r._routed_since_poll.get(worker.worker_id)
                expected.append(
                    WorkerLoad.from_stats(
                        worker.stats,
                        healthy=worker.healthy,
                        inflight=routed.requests if routed else 0,
                        inflight_prompt_tokens=routed.tokens if routed else 0,
                        inflight_blocks=routed.blocks if routed else 0,
                        recent_blocks=r._recent_blocks.get(worker.worker_id, 0),
                    )
                )
            assert list(rows) == expected
            assert rows.numbers.T.tolist() == [list(load.numbers) for load in expected]
            assert rows.all_healthy == all(load.healthy for load in expected)

    for i, worker in enumerate(pool.workers.values()):
        poll(worker, i % 3)
    rows_are_loads()
    routes = [r.choose(SYSTEM + [1000 + i], 8, set()) for i in range(4)]
    rows_are_loads()
    r.on_prompt_computed(routes[0])
    rows_are_loads()
    pool.mark_unhealthy("decode-1", "test")
    rows_are_loads()
    retry = r.choose(SYSTEM + [2000], 8, {routes[1].decode_worker})
    assert retry.decode_worker not in {"decode-1", routes[1].decode_worker}
    rows_are_loads()
    poll(pool.workers["decode-1"], 2)  # healthy again
    poll(pool.workers[routes[2].decode_worker], 0)
    rows_are_loads()


def test_a_hybrid_worker_is_one_row_in_both_roles_and_counts_in_the_role_it_plays() -> None:
    pool = WorkerPool({}, {}, hybrid={"h0": None, "h1": None})  # no actor is ever called
    for worker in pool.workers.values():
        worker.healthy = True
        worker.stats = WorkerStats(worker.worker_id, "hybrid", epoch=1, bytes_per_block=8192)
    r = Routing(pool, RoutingPolicy(RouterConfig(disaggregate="always")), BLOCK)
    assert [w.worker_id for w in pool.of_role("prefill")] == ["h0", "h1"]
    assert [w.worker_id for w in pool.of_role("decode")] == ["h0", "h1"]
    route = r.choose(SYSTEM, 8, set())
    assert {route.prefill_worker, route.decode_worker} == {"h0", "h1"}  # never one for both
    # The prefilling worker's new row, in both roles' loads (the same WorkerLoad).
    prefiller = route.prefill_worker
    assert r._rows["prefill"].of(prefiller) is r._rows["decode"].of(prefiller)
    assert r._rows["decode"].of(prefiller).inflight_prompt_tokens == len(SYSTEM)
    assert r._rows["decode"].of(prefiller).hybrid
    with pool.occupied([route.decode_worker, route.prefill_worker]):
        assert (pool.inflight("decode"), pool.inflight("prefill")) == (1, 1)
        assert r.pending() == 1
    assert (pool.inflight("decode"), pool.inflight("prefill")) == (0, 0)
