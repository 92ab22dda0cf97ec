"""The cost policy's vectorised decision (router/option_matrix.py) against the enumeration."""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.config import RouterConfig
from pdserve.core.messages import WorkerStats
from router.cost_model import CostModel
from router.disaggregate_rule import option_kinds
from router.estimates import RoutingRequest, WorkerLoad
from router.load_rows import LoadRows
from router.option_matrix import Limits, OptionMatrix
from router.policy import RoutingPolicy

MiB = 1 << 20


@st.composite
def worker_loads(draw, prefix: str, count: int) -> list[WorkerLoad]:
    workers = []
    for i in range(count):
        num_blocks = draw(st.sampled_from([0, 64, 500, 4096]))
        free = draw(st.integers(0, num_blocks))
        waiting = draw(st.integers(0, 2))
        queries = draw(st.sampled_from([0, 3000, 100_000]))
        workers.append(
            WorkerLoad(
                f"{prefix}{i}",
                healthy=draw(st.booleans()) or i == 0,
                num_waiting=waiting,
                num_running=draw(st.sampled_from([0, 1, 8, 64])),
                waiting_prompt_tokens=waiting * draw(st.sampled_from([0, 100, 2000, 9000])),
                num_blocks=num_blocks,
                num_free_blocks=free,
                inflight=draw(st.integers(0, 2)),
                inflight_prompt_tokens=draw(st.sampled_from([0, 512, 4096])),
                inflight_blocks=draw(st.sampled_from([0, 20, 300])),
                # Cached prefixes among the free blocks, and how much of them requests reuse.
                num_evictable_blocks=draw(st.integers(0, free)),
                prefix_hit_tokens=draw(st.integers(0, queries)),
                prefix_query_tokens=queries,
                recent_blocks=draw(st.sampled_from([0, 300, num_blocks + 100])),
            )
        )
    return workers


@st.composite
def situations(draw):
    prefill = draw(worker_loads("p", draw(st.integers(0, 5))))
    decode = draw(worker_loads("d", draw(st.integers(1, 5))))
    if draw(st.booleans()):  # hybrid decode workers (--hybrid), listed as prefill workers too
        decode = [dataclasses.replace(d, hybrid=True) for d in decode]
        prefill = prefill[: draw(st.integers(0, len(prefill)))] + decode
    request = RoutingRequest(
        prompt_tokens=draw(st.integers(1, 6000)),
        max_tokens=draw(st.sampled_from([1, 16, 256])),
        block_size=16,
        bytes_per_block=draw(st.sampled_from([0, MiB, 64 * MiB])),
    )
    # Few distinct prefix lengths, so that equal objectives and tie keys are common.
    lengths = st.sampled_from([0, 0, 8, 40, 400])
    cached = {w.worker_id: draw(lengths) for w in prefill + decode if draw(st.booleans())}
    config = RouterConfig(
        disaggregate=draw(st.sampled_from(["auto", "always", "never"])),
        ttft_slo_ms=draw(st.sampled_from([50.0, 400.0, 5000.0])),
        max_queued_prefill_tokens=draw(st.sampled_from([2048, 16384])),
        peer_pull=draw(st.booleans()),  # local options may then pull a peer's longer prefix
    )
    cost = CostModel()
    lines = draw(st.sampled_from(["prior", "measured", "cheap", "drained"]))
    if lines == "measured":  # the local line slower: both prefill fits count
        for tokens in (100, 1000, 3000):
            cost.observe_request_prefill(tokens, 0.002 + tokens * 3e-4, local=True)
            cost.observe_request_prefill(tokens, 0.001 + tokens * 1e-4)
        cost.observe_decode_step(32, 0.03)
    if lines == "drained":  # prefill workers' polls measure how fast their queues drain
        cost.observe_stats(WorkerStats("p0", "prefill", 1))
        cost.observe_stats(
            WorkerStats("p0", "prefill", 1, prefill_tokens=4096, prefill_seconds=0.3)
        )
    if lines == "cheap":  # a cached prefix saves less than the tie tolerance: tie keys decide
        for _ in range(50):
            cost.observe_prefill(1024, 0.001)
    return request, prefill, decode, cached, config, cost


def _rows(loads: list[WorkerLoad]) -> LoadRows:
    rows = LoadRows(w.worker_id for w in loads)
    for load in loads:
        rows.set(load)
    return rows


@settings(max_examples=400, deadline=None)
@given(situations(), st.integers(0, 5))
def test_vectorised_decision_is_the_enumerations(situation, turn) -> None:
    """Same option (rotation included), same Estimate, and every option's objective equal bit
    for bit, on random loads, caches, modes, SLOs and cost lines."""
    _assert_vectorised_is_the_enumeration(*situation, turn)


@settings(max_examples=300, deadline=None)
@given(situations(), st.integers(0, 5))
def test_vectorised_decision_with_peer_pulls_is_the_enumerations(situation, turn) -> None:
    """The same with --peer-pull on a link fast enough that local options often pull a peer's
    longer prefix: their TTFT, compute and stall priced with the pull, bit for bit."""
    request, prefill, decode, cached, config, cost = situation
    config = dataclasses.replace(config, peer_pull=True)
    request = dataclasses.replace(request, bytes_per_block=MiB)
    for tokens in (100, 1000, 3000):  # 10 GB/s against a prefill of ~0.3 ms a token
        cost.observe_request_prefill(tokens, 0.002 + tokens * 3e-4, local=True)
        cost.observe_transfer(tokens * MiB, tokens * MiB / 1e10)
    _assert_vectorised_is_the_enumeration(request, prefill, decode, cached, config, cost, turn)


def _assert_vectorised_is_the_enumeration(request, prefill, decode, cached, config, cost, turn):
    fast = RoutingPolicy(config, cost)
    slow = RoutingPolicy(config, cost, vectorised=False)
    from_rows = RoutingPolicy(config, cost)  # the loads as the router keeps them (LoadRows)
    for _ in range(turn):  # advance every rotation alike
        next(fast._turn), next(slow._turn), next(from_rows._turn)
    got = fast.decide(request, prefill, decode, cached)
    want = slow.decide(request, prefill, decode, cached)
    assert (got.status, got.reason) == (want.status, want.reason)
    assert got.chosen == want.chosen
    assert dict(got.estimates) == dict(want.estimates)
    # A prefix held by a worker no longer in the pool changes nothing.
    rows = from_rows.decide(request, _rows(prefill), _rows(decode), {**cached, "gone": 400})
    assert (rows.status, rows.reason, rows.chosen) == (want.status, want.reason, want.chosen)
    assert dict(rows.estimates) == dict(want.estimates)

    healthy_p = [p for p in prefill if p.healthy]
    healthy_d = [d for d in decode if d.healthy]
    remote, local = option_kinds(slow.mode, request, healthy_p, healthy_d, cached)
    matrix = OptionMatrix.build(
        request, healthy_p, healthy_d, cached, cost, slow._limits, remote=remote, local=local,
        prune=False,
    )  # fmt: skip
    options = list(want.estimates.values())
    # The matrix has a cell for a hybrid worker paired with itself, never feasible; the
    # enumeration has no such option.
    pairs = [matrix.workers(i) for i in range(matrix.objective.size)]
    own = [p is not None and healthy_p[p].worker_id == healthy_d[d].worker_id for p, d in pairs]
    assert not matrix.feasible.ravel()[own].any()
    kept = ~np.array(own, dtype=bool)
    assert int(kept.sum()) == len(options)
    feasible = [o for o in options if o.infeasible is None]
    assert matrix.feasible.ravel()[kept].tolist() == [o.infeasible is None for o in options]
    if feasible:  # objectives depend on the best feasible TTFT
        assert matrix.objective.ravel()[kept].tolist() == [o.objective for o in options]
        # Dropping dominated prefill workers leaves the same options tied, in the same order.
        pruned = OptionMatrix.build(
            request, healthy_p, healthy_d, cached, cost, slow._limits, remote=remote,
            local=local, prune=True,
        )  # fmt: skip
        ties = [
            matrix.workers(i) for i in matrix.cost_ties(fast.tie_tolerance, fast.kind_tie_tolerance)
        ]
        assert [
            pruned.workers(i) for i in pruned.cost_ties(fast.tie_tolerance, fast.kind_tie_tolerance)
        ] == ties


def test_estimates_are_built_only_when_read() -> None:
    policy = RoutingPolicy(RouterConfig())
    request = RoutingRequest(prompt_tokens=1024, max_tokens=64, block_size=16)
    decision = policy.decide(request, [WorkerLoad("p0")], [WorkerLoad("d0"), WorkerLoad("d1")])
    assert decision.estimates._estimates is None
    assert set(decision.estimates) == {"p0->d0", "local@d0", "p0->d1", "local@d1"}
    assert decision.estimates[decision.chosen.name] == decision.chosen


def test_a_decision_over_12480_options_takes_milliseconds() -> None:
    """64 prefill x 192 decode workers (issue 14, 5c): enumerated one by one this was ~27 us of
    Python per option, ~0.3 s per decision."""
    prefill = [WorkerLoad(f"p{i}", num_waiting=i % 3, waiting_prompt_tokens=i * 40) for i in range(64)]  # fmt: skip
    decode = [
        WorkerLoad(f"d{i}", num_running=i % 50, num_blocks=27_000, num_free_blocks=9000 + i)
        for i in range(192)
    ]
    cached = {f"p{i}": i % 7 for i in range(64)} | {f"d{i}": i % 5 for i in range(192)}
    request = RoutingRequest(prompt_tokens=4096, max_tokens=256, block_size=16, bytes_per_block=MiB)
    policy = RoutingPolicy(RouterConfig())
    seconds = []
    for _ in range(7):
        start = time.thread_time()
        assert policy.decide(request, prefill, decode, cached).accepted
        seconds.append(time.thread_time() - start)
    assert statistics.median(seconds) < 0.02


def test_no_feasible_option_is_an_empty_matrix_pick() -> None:
    full = WorkerLoad("d0", num_blocks=16, num_free_blocks=0)
    request = RoutingRequest(prompt_tokens=1024, max_tokens=64, block_size=16)
    limits = Limits(1.0, 0.1, 4096, RoutingPolicy(RouterConfig()).weights)
    matrix = OptionMatrix.build(
        request, [WorkerLoad("p0")], [full], {}, CostModel(), limits, remote=True, local=True
    )
    assert not matrix.feasible.any() and np.isinf(matrix.best_ttft_s)
    decision = RoutingPolicy(RouterConfig()).decide(request, [WorkerLoad("p0")], [full])
    assert decision.status == "at_capacity" and "d0 has 0 free KV blocks" in decision.reason


def test_pruned_matrix_picks_as_the_enumeration_at_scale() -> None:
    """24 prefill x 40 decode workers with few distinct loads and prefixes: most prefill workers
    are dominated and dropped, and ten decisions in a row (rotation included) stay the same."""
    rng = np.random.default_rng(3)
    prefill = [
        WorkerLoad(f"p{i}", num_waiting=int(rng.integers(0, 3)),
                   waiting_prompt_tokens=int(rng.choice([0, 500, 3000])))
        for i in range(24)
    ]  # fmt: skip
    decode = [
        WorkerLoad(f"d{i}", num_running=int(rng.choice([4, 32])), num_blocks=27_000,
                   num_free_blocks=int(rng.choice([5000, 20000])))
        for i in range(40)
    ]  # fmt: skip
    cached = {w.worker_id: int(rng.choice([0, 16, 200])) for w in prefill + decode}
    request = RoutingRequest(prompt_tokens=4096, max_tokens=256, block_size=16, bytes_per_block=MiB)
    fast = RoutingPolicy(RouterConfig())
    slow = RoutingPolicy(RouterConfig(), vectorised=False)
    matrix = OptionMatrix.build(
        request, prefill, decode, cached, fast.cost, fast._limits, remote=True, local=True
    )
    assert len(matrix.prefill_positions) < len(prefill) / 2
    for _ in range(10):
        got = fast.decide(request, prefill, decode, cached)
        assert got.chosen == slow.decide(request, prefill, decode, cached).chosen


def test_a_faster_holder_with_a_full_queue_does_not_hide_an_admissible_worker() -> None:
    """p0 holds the whole prompt and would be first to the first token, but its prompt queue is
    full; p1 must stay in the matrix (else the decode worker would prefill locally)."""
    request = RoutingRequest(prompt_tokens=4096, max_tokens=64, block_size=16)
    prefill = [WorkerLoad("p0", num_waiting=1, waiting_prompt_tokens=2100), WorkerLoad("p1")]
    config = RouterConfig(max_queued_prefill_tokens=2048)
    decision = RoutingPolicy(config).decide(request, prefill, [WorkerLoad("d0")], {"p0": 256})
    assert decision.prefill_worker == "p1"
    assert decision.estimates["p0->d0"].infeasible
    assert decision.estimates["p0->d0"].ttft_s < decision.chosen.ttft_s
