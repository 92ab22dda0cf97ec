"""Routing decisions: local vs remote prefill, affinity, ties, admission control, baselines."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from pdserve.config import RouterConfig
from pdserve.core.messages import WorkerStats
from router.cost_model import CostModel
from router.estimates import RoutingRequest, WorkerLoad
from router.policy import RoutingPolicy

MiB = 1 << 20
# 1024 prompt tokens = 64 blocks of 16; 1 MiB of KV per block (a 7B-class model in bf16).
LONG = RoutingRequest(prompt_tokens=1024, max_tokens=64, block_size=16, bytes_per_block=MiB)


def worker(worker_id: str, **load) -> WorkerLoad:
    load.setdefault("num_blocks", 4096)
    load.setdefault("num_free_blocks", load["num_blocks"])
    return WorkerLoad(worker_id, **load)


def policy(**config) -> RoutingPolicy:
    return RoutingPolicy(RouterConfig(**config))


def test_idle_decode_worker_prefills_locally() -> None:
    # Nothing runs on D, so a local prefill hurts no one and saves the KV transfer.
    decision = policy().decide(LONG, [worker("p0")], [worker("d0")])
    assert decision.accepted
    assert (decision.prefill_worker, decision.decode_worker) == (None, "d0")
    assert set(decision.estimates) == {"p0->d0", "local@d0"}
    assert decision.estimates["p0->d0"].transfer_blocks == 64


def test_busy_decode_worker_gets_a_remote_prefill() -> None:
    # A local prefill would stall 32 running decodes; the transfer is cheaper than that.
    decision = policy().decide(LONG, [worker("p0")], [worker("d0", num_running=32)])
    assert (decision.prefill_worker, decision.decode_worker) == ("p0", "d0")
    chosen, local = decision.chosen, decision.estimates["local@d0"]
    assert chosen.ttft_s > local.ttft_s  # remote is slower to the first token ...
    assert chosen.objective < local.objective  # ... but protects the running decodes
    assert local.stall_s > 0 and chosen.stall_s == 0


def test_disaggregate_modes_are_obeyed() -> None:
    idle = ([worker("p0")], [worker("d0")])
    assert policy(disaggregate="always").decide(LONG, *idle).prefill_worker == "p0"
    busy = ([worker("p0")], [worker("d0", num_running=32)])
    assert policy(disaggregate="never").decide(LONG, *busy).prefill_worker is None
    # "always" with no healthy prefill worker still serves, locally.
    sick = policy(disaggregate="always").decide(LONG, [worker("p0", healthy=False)], idle[1])
    assert sick.accepted and sick.prefill_worker is None


def test_prefill_worker_holding_the_prefix_is_preferred() -> None:
    workers = [worker("p0"), worker("p1")]
    decode = [worker("d0", num_running=16)]
    decision = policy().decide(LONG, workers, decode, cached_blocks={"p1": 48})
    assert decision.prefill_worker == "p1"
    assert decision.cached_tokens == 48 * 16


def test_conversation_returns_to_the_decode_worker_holding_its_history() -> None:
    decode = [worker("d0", num_running=4), worker("d1", num_running=4)]
    cached = {"d1": 60}  # the previous turns live on d1
    for mode in ("auto", "always"):
        decision = policy(disaggregate=mode).decide(LONG, [worker("p0")], decode, cached)
        assert decision.decode_worker == "d1", mode
        assert decision.decode_cached_tokens == 60 * 16
    assert (
        policy(disaggregate="always")
        .decide(LONG, [worker("p0")], decode, cached)
        .chosen.transfer_blocks
        == 4
    )


def test_affinity_yields_when_the_history_holder_is_overloaded() -> None:
    cached = {"d1": 60}
    crowded = [worker("d0", num_running=4), worker("d1", num_running=250)]
    assert policy().decide(LONG, [worker("p0")], crowded, cached).decode_worker == "d0"
    full = [worker("d0"), worker("d1", num_free_blocks=2)]  # d1 cannot reserve 4 blocks
    decision = policy().decide(LONG, [worker("p0")], full, cached)
    assert decision.decode_worker == "d0"
    assert decision.estimates["local@d1"].infeasible


def test_ties_are_broken_by_load() -> None:
    # Equal estimates (prefill running counts do not enter them): the less loaded one wins.
    prefill = [worker("p0", num_running=3), worker("p1")]
    decode = [worker("d0", num_running=32)]
    picks = {policy().decide(LONG, prefill, decode).prefill_worker for _ in range(4)}
    assert picks == {"p1"}


def test_a_cached_prefix_breaks_a_tie_before_load() -> None:
    # A cheap model: the cached 48 blocks save ~1 ms, within the tie tolerance. The holder is
    # still preferred, even a little busier, so the other worker does not compute it again.
    cost = CostModel()
    for _ in range(50):
        cost.observe_prefill(1024, 0.001)
    prefill = [worker("p0", num_running=1), worker("p1")]
    decision = RoutingPolicy(RouterConfig(disaggregate="always"), cost).decide(
        LONG, prefill, [worker("d0", num_running=32)], cached_blocks={"p0": 48}
    )
    assert decision.prefill_worker == "p0"


def test_holder_of_the_prefix_beats_an_idle_worker_that_would_recompute_it() -> None:
    # ~1 ms per token: p0 holds 48 of 64 blocks but has 900 tokens queued; p1 is idle. p0 is a
    # little slower to the first token, but p1 would spend 4x the compute on the same prompt.
    cost = CostModel()
    for tokens in (256, 512, 1024):
        for _ in range(20):
            cost.observe_prefill(tokens, 0.001 * tokens)
    prefill = [worker("p0", waiting_prompt_tokens=900, num_waiting=1), worker("p1")]
    decision = RoutingPolicy(RouterConfig(), cost).decide(
        LONG, prefill, [worker("d0", num_running=32)], cached_blocks={"p0": 48}
    )
    assert decision.prefill_worker == "p0"
    chosen, idle = decision.chosen, decision.estimates["p1->d0"]
    assert chosen.ttft_s > idle.ttft_s and chosen.compute_s < idle.compute_s


def test_identical_workers_share_the_load() -> None:
    pol = policy()
    prefill = [worker("p0"), worker("p1")]
    decode = [worker("d0", num_running=32)]
    # Ties go to the less loaded of two drawn at random (equal here: the first drawn).
    picks = Counter(pol.decide(LONG, prefill, decode).prefill_worker for _ in range(100))
    assert set(picks) == {"p0", "p1"} and min(picks.values()) >= 35, picks


def test_measured_costs_change_the_decision() -> None:
    cost = CostModel()
    pol = RoutingPolicy(RouterConfig(), cost)
    idle = ([worker("p0")], [worker("d0")])
    assert pol.decide(LONG, *idle).prefill_worker is None
    for _ in range(50):  # prefill on the decode worker turns out 20x slower than on p0
        cost.observe_prefill(1024, 2.0, local=True)
        cost.observe_prefill(1024, 0.1)
    assert pol.decide(LONG, *idle).prefill_worker == "p0"


def test_router_overload_is_rejected() -> None:
    decision = policy(max_pending_requests=8).decide(
        LONG, [worker("p0")], [worker("d0")], pending_requests=8
    )
    assert not decision.accepted and decision.status == "resource_exhausted"
    assert "max_pending_requests=8" in decision.reason


def test_no_kv_room_anywhere_is_rejected() -> None:
    decode = [worker("d0", num_free_blocks=10), worker("d1", num_free_blocks=63)]
    decision = policy().decide(LONG, [worker("p0")], decode)
    assert decision.status == "at_capacity"
    assert "free KV blocks" in decision.reason
    assert all(e.infeasible for e in decision.estimates.values())


def test_full_prefill_queues_are_rejected_not_queued() -> None:
    cfg = {"max_queued_prefill_tokens": 4096}
    prefill = [worker("p0", waiting_prompt_tokens=4000, num_waiting=4)]
    decode = [worker("d0", waiting_prompt_tokens=3500, num_waiting=3)]
    decision = policy(**cfg).decide(LONG, prefill, decode)
    assert decision.status == "at_capacity" and "prefill queue" in decision.reason
    # A request that fits in what is left of a queue is still taken.
    assert policy(**cfg).decide(LONG, [worker("p0", waiting_prompt_tokens=3000)], decode).accepted
    # An empty queue takes even a prompt longer than the limit (it could never run otherwise).
    assert policy(max_queued_prefill_tokens=512).decide(LONG, [worker("p0")], decode).accepted


def test_no_healthy_decode_worker_is_unavailable() -> None:
    decision = policy().decide(LONG, [worker("p0")], [worker("d0", healthy=False)])
    assert decision.status == "unavailable"


def test_unhealthy_workers_are_never_chosen() -> None:
    prefill = [worker("p0", healthy=False), worker("p1", waiting_prompt_tokens=2000)]
    decode = [worker("d0", healthy=False), worker("d1", num_running=32)]
    decision = policy().decide(LONG, prefill, decode)
    assert (decision.prefill_worker, decision.decode_worker) == ("p1", "d1")


def test_round_robin_baseline_rotates() -> None:
    pol = policy(policy="round_robin")
    prefill, decode = [worker("p0"), worker("p1")], [worker("d0"), worker("d1")]
    picks = [pol.decide(LONG, prefill, decode) for _ in range(4)]
    first, second = picks[0].decode_worker, picks[1].decode_worker  # starts at a drawn worker
    assert {first, second} == {"d0", "d1"}
    assert [d.decode_worker for d in picks] == [first, second, first, second]
    assert Counter(d.prefill_worker for d in picks) == {"p0": 2, "p1": 2}
    assert (
        policy(policy="round_robin", disaggregate="never")
        .decide(LONG, prefill, decode)
        .prefill_worker
        is None
    )


def test_least_loaded_baseline() -> None:
    prefill = [worker("p0", waiting_prompt_tokens=900), worker("p1", waiting_prompt_tokens=100)]
    decode = [worker("d0", num_running=9), worker("d1", num_running=2)]
    decision = policy(policy="least_loaded").decide(LONG, prefill, decode, {"p0": 64})
    assert (decision.prefill_worker, decision.decode_worker) == ("p1", "d1")  # cache-blind


@pytest.mark.parametrize(
    "config", [{"policy": "fastest"}, {"disaggregate": "sometimes"}, {"ttft_slo_ms": 0}]
)
def test_bad_configuration_is_refused(config: dict) -> None:
    with pytest.raises(ValueError):
        policy(**config)


def test_worker_stats_feed_the_policy() -> None:
    stats = WorkerStats(
        worker_id="d0", role="decode", epoch=1, num_running=32, num_waiting=1, num_reserved=2,
        waiting_prompt_tokens=300, num_blocks=512, num_free_blocks=100,
    )  # fmt: skip
    load = WorkerLoad.from_stats(stats, inflight=1, inflight_prompt_tokens=50)
    assert (load.queued_requests, load.queued_tokens, load.load) == (4, 350, 36)
    assert policy().decide(LONG, [worker("p0")], [load]).prefill_worker == "p0"


def calibrated(intercept: float = 0.02, per_token: float = 2.5e-4) -> CostModel:
    """A CostModel that has measured a small model's prefills (per request) and decode steps."""
    cost = CostModel()
    for tokens in (32, 128, 288, 512):
        for _ in range(10):
            cost.observe_request_prefill(tokens, intercept + per_token * tokens)
    for batch in (1, 2, 4):
        for _ in range(10):
            cost.observe_decode_step(batch, 0.008 + 0.001 * batch)
    return cost


# A shared-prefix chat turn: 256-token system prompt (16 blocks) + 32-token question; a small
# model's KV (32 KiB a block) transfers in a few milliseconds.
CHAT = RoutingRequest(prompt_tokens=288, max_tokens=8, block_size=16, bytes_per_block=32 << 10)


def test_an_idle_decode_worker_does_not_prefill_a_cold_prompt_when_transfers_are_cheap() -> None:
    # Nothing to reuse on D, so a local prefill saves only the transfer; meanwhile it stalls
    # whatever the router sends to D next, which the objective now counts.
    pol = RoutingPolicy(RouterConfig(), calibrated())
    decision = pol.decide(CHAT, [worker("p0"), worker("p1")], [worker("d0"), worker("d1")])
    assert decision.prefill_worker in ("p0", "p1")
    local = decision.estimates["local@d0"]
    assert local.terms["interference"] > 0 and local.ttft_s < decision.chosen.ttft_s


def test_an_idle_decode_worker_holding_the_prefix_prefills_locally() -> None:
    # D holds the system prompt and no prefill worker does: 32 tokens locally beat 288 remotely.
    pol = RoutingPolicy(RouterConfig(), calibrated())
    decision = pol.decide(CHAT, [worker("p0")], [worker("d0"), worker("d1")], {"d1": 16})
    assert (decision.prefill_worker, decision.decode_worker) == (None, "d1")


def test_a_short_prompt_queued_on_the_holder_does_not_send_its_group_elsewhere() -> None:
    # Costs as measured on a busy CPU pool: a large fixed cost per prefill. The holder of the
    # 256-token system prompt has one 32-token prompt queued (sharing the next step with this
    # one); the idle worker would compute the system prompt again. Charging the queue a whole
    # intercept per request sent the request away. (Remote only: which prefill worker.)
    pol = RoutingPolicy(
        RouterConfig(disaggregate="always"), calibrated(intercept=0.16, per_token=3e-4)
    )
    prefill = [worker("p0", inflight=1, inflight_prompt_tokens=32), worker("p1")]
    decode = [worker("d0"), worker("d1")]
    decision = pol.decide(CHAT, prefill, decode, {"p0": 16, "d0": 16})
    assert decision.prefill_worker == "p0"
    # Really busy, the holder does yield: recomputing beats waiting behind 2000 tokens.
    busy = [worker("p0", num_waiting=4, waiting_prompt_tokens=2000), worker("p1")]
    assert pol.decide(CHAT, busy, decode, {"p0": 16, "d0": 16}).prefill_worker == "p1"


@pytest.mark.parametrize("vectorised", [True, False])
def test_a_full_worker_holding_the_prefix_keeps_the_turn_that_adds_little_to_it(vectorised):
    # Saturated multi-tenant serving (docs/benchmarks/routing.md, seventh part): the tenant's
    # home worker runs its users on one cached 256-block prefix, its pool 95% held; another
    # worker has room but would compute the prefix and hold 260 more blocks, evicting other
    # tenants'. KV pressure charges what a request adds above the soft limit (12 blocks here),
    # not the occupancy it finds: charged the occupancy, such turns left their cache and the
    # recomputation fed every queue (cost's hit rate fell from 95% to 69%).
    turn = RoutingRequest(prompt_tokens=260 * 16, max_tokens=64, block_size=16)
    home = worker("home", num_blocks=2048, num_free_blocks=104, num_running=40, num_waiting=6,
                  waiting_prompt_tokens=11_648)  # fmt: skip
    roomy = worker("roomy", num_blocks=2048, num_free_blocks=672, num_running=40, num_waiting=6,
                   waiting_prompt_tokens=4_928)  # fmt: skip
    chooser = RoutingPolicy(RouterConfig(ttft_slo_ms=400), vectorised=vectorised)
    decision = chooser.decide(turn, [], [home, roomy], {"home": 256})
    assert (decision.decode_worker, decision.cached_tokens) == ("home", 256 * 16)
    pressure = decision.chosen.terms["kv_pressure"]
    assert 0 < pressure < 0.2  # 12 blocks past 95%: a small price, not the whole overshoot


@pytest.mark.parametrize("vectorised", [True, False])
def test_a_cold_prefix_goes_where_it_evicts_no_reused_prefix(vectorised):
    # Three workers of 1024 blocks, all idle between turns: their pools hold tenants' cached
    # prefixes (256 blocks each), which count as free (an allocation evicts them). "crowded"
    # caches three tenants, "roomy" two, and their turns find 90% of their prompts cached.
    # A new tenant's cold 260-block prefix on "crowded" would evict a prefix its next turn
    # needs: charged as held, the reused cache steers it to "roomy" under every seed (counted
    # free, it was a tie, and one run put four tenants on one worker: routing.md, ninth part).
    cold = RoutingRequest(prompt_tokens=260 * 16, max_tokens=64, block_size=16)
    reuse = dict(num_blocks=1024, num_free_blocks=1000, prefix_hit_tokens=9, prefix_query_tokens=10)
    crowded = worker("crowded", num_evictable_blocks=768, **reuse)
    roomy = worker("roomy", num_evictable_blocks=512, **reuse)
    for seed in range(8):
        chooser = RoutingPolicy(RouterConfig(ttft_slo_ms=400), seed=seed, vectorised=vectorised)
        decision = chooser.decide(cold, [], [crowded, roomy])
        assert decision.decode_worker == "roomy"
        assert decision.estimates["local@crowded"].terms["kv_pressure"] > 1
    # A cache nobody reuses (no hits) is free room: it does not count.
    unused = dict(reuse, prefix_hit_tokens=0)
    crowded, roomy = (dataclasses.replace(w, **unused) for w in (crowded, roomy))
    chooser = RoutingPolicy(RouterConfig(ttft_slo_ms=400), vectorised=vectorised)
    options = chooser.decide(cold, [], [crowded, roomy]).estimates
    assert options["local@crowded"].terms == options["local@roomy"].terms
    # Unless the router just sent those prefixes there: at the start, the workers' first
    # turns were all cold (no hits yet), and the tenants' next turns reuse every prefix.
    crowded = dataclasses.replace(crowded, recent_blocks=3 * 260)
    roomy = dataclasses.replace(roomy, recent_blocks=2 * 260)
    for seed in range(8):
        chooser = RoutingPolicy(RouterConfig(ttft_slo_ms=400), seed=seed, vectorised=vectorised)
        assert chooser.decide(cold, [], [crowded, roomy]).decode_worker == "roomy"


@pytest.mark.parametrize("vectorised", [True, False])
def test_a_remote_prefill_on_a_hybrid_worker_is_priced_as_the_stall_of_its_decodes(
    vectorised,
) -> None:
    # Three hybrid workers (--hybrid): each is a prefill and a decode worker. d0 decodes 32
    # requests, so a local prefill there stalls them; h1 decodes 32 too, h2 nothing. A prefill
    # on h1 stalls h1's decodes as much as a local one stalls d0's: only h2's is cheap.
    busy, idle = dict(num_running=32, hybrid=True), dict(hybrid=True)
    workers = [worker("d0", **busy), worker("h1", **busy), worker("h2", **idle)]
    decision = RoutingPolicy(RouterConfig(), vectorised=vectorised).decide(
        LONG, workers, workers[:1]
    )
    assert (decision.prefill_worker, decision.decode_worker) == ("h2", "d0")
    options = decision.estimates
    assert "d0->d0" not in options  # its own prefill is the local option
    on_busy, on_idle = options["h1->d0"], options["h2->d0"]
    assert on_busy.prefill_stall_s > 0 and on_busy.prefill_stalled == 32
    assert on_busy.terms["interference"] > on_idle.terms["interference"] > 0
    # The same busy worker as a prefill-only worker stalls no decodes: what is left is d0's
    # slowdown with one more request, less than even the idle hybrid's stall of newcomers.
    plain = RoutingPolicy(RouterConfig(), vectorised=vectorised).decide(
        LONG, [worker("h1", num_running=32)], workers[:1]
    )
    assert plain.estimates["h1->d0"].terms["interference"] < on_idle.terms["interference"]


def test_a_lone_hybrid_worker_prefills_locally_whatever_the_mode() -> None:
    alone = [worker("h0", hybrid=True)]
    for mode in ("always", "auto", "threshold:16"):
        decision = policy(disaggregate=mode).decide(LONG, alone, alone)
        assert decision.accepted and decision.prefill_worker is None
