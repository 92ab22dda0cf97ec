"""`--disaggregate auto` prices a remote prefill's handoff and a local prefill's decode stall
from measured costs (router/handoff_costs.py, router/estimates.py): decisions on constructed
loads, and the router learning the handoff from a remote prefill's timings."""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.core.messages import PrefillResult, WorkerStats
from router.cost_model import CostModel
from router.estimates import RoutingRequest, WorkerLoad
from router.handoff_costs import HandoffCost
from router.policy import RoutingPolicy
from router.routing import Routing
from router.worker_pool import WorkerPool

BLOCK = 16
BYTES_PER_BLOCK = 16 * 128 * 1024  # an 8B model's KV: 128 KiB per token


def learned(handoff_s: float | None) -> CostModel:
    """The default cost model after 50 remote prefills whose handoff took `handoff_s`."""
    cost = CostModel()
    for _ in range(50 if handoff_s is not None else 0):
        cost.observe_handoff(handoff_s)
    return cost


def prefills_remotely(
    prompt_tokens: int, cost: CostModel, running: int = 0, tpot_slo_ms: float = 50.0
) -> bool:
    policy = RoutingPolicy(
        RouterConfig(disaggregate="auto", ttft_slo_ms=1000, tpot_slo_ms=tpot_slo_ms), cost=cost
    )
    request = RoutingRequest(prompt_tokens, 32, BLOCK, bytes_per_block=BYTES_PER_BLOCK)
    decode = WorkerLoad("d0", num_running=running, num_blocks=100_000, num_free_blocks=90_000)
    prefill = WorkerLoad("p0", num_blocks=100_000, num_free_blocks=100_000)
    decision = policy.decide(request, [prefill], [decode])
    assert decision.accepted, decision.reason
    return decision.prefill_worker is not None


def shortest_remote(cost: CostModel, running: int) -> int:
    """The shortest prompt (in steps of a block) that the policy prefills remotely."""
    return next(t for t in range(BLOCK, 20_000, BLOCK) if prefills_remotely(t, cost, running))


def test_the_handoff_cost_is_the_forgetting_mean_of_what_was_observed() -> None:
    cost = HandoffCost(prior_s=0.002)
    assert cost.seconds == 0.002  # no data: the prior
    for _ in range(200):
        cost.observe(0.030)
    assert abs(cost.seconds - 0.030) < 1e-4  # the prior has faded
    cost.observe(-1.0)  # a clock step is no measurement
    assert cost.samples == 200
    assert HandoffCost(prior_s=0.002).scaled(30).seconds == 0.06


def test_a_short_prompt_on_an_idle_system_stays_local_once_the_handoff_is_measured() -> None:
    # Without a price for the round trips a 64-token prompt's two options tie (its KV transfer
    # is ~1 ms) and the tie went to the remote one: the 99% remote prefills of short prompts.
    assert not prefills_remotely(64, learned(0.010))
    assert not prefills_remotely(256, learned(0.010))


def test_a_long_prompt_beside_a_tpot_bound_decode_batch_goes_remote() -> None:
    # 40 running requests: a decode step of ~18 ms against a 20 ms TPOT. A 4096-token local
    # prefill's chunks would push the batch's TPOT past the SLO: remote, whatever the handoff.
    cost = learned(0.050)
    assert prefills_remotely(4096, cost, running=40, tpot_slo_ms=20)
    # The same prompt on an idle decode worker under a loose TPOT stalls nobody: local.
    assert not prefills_remotely(4096, cost, running=0, tpot_slo_ms=50)


def test_the_learned_handoff_cost_moves_the_threshold() -> None:
    # On a decode worker with 4 running requests, a dearer handoff keeps longer prompts local.
    cheap, dear = shortest_remote(learned(0.001), 4), shortest_remote(learned(0.050), 4)
    assert dear > cheap
    assert not prefills_remotely(dear - BLOCK, learned(0.050), running=4)


def test_the_router_learns_the_handoff_from_a_remote_prefills_timings() -> None:
    pool = WorkerPool({"prefill-0": None}, {"decode-0": None})  # no actor is ever called
    for worker in pool.workers.values():
        worker.healthy = True
        worker.stats = WorkerStats(
            worker.worker_id, worker.role, epoch=1, num_blocks=4096, num_free_blocks=4096,
            bytes_per_block=8192,
        )  # fmt: skip
    now = [100.0]
    r = Routing(pool, RoutingPolicy(RouterConfig(disaggregate="always")), BLOCK)
    r.clock = lambda: now[0]
    prompt = list(range(2, 300))
    route = r.choose(prompt, 8, set())
    assert route.prefill_worker == "prefill-0"
    now[0] += 0.100  # the first answer: 100 ms after routing
    r.on_prompt_computed(route)
    now[0] += 0.020  # the push and commit
    r.on_prefill_done(route, PrefillResult(
        request_id="r", worker_id="prefill-0", first_token_id=1, first_logprob=None,
        finished=False, finish_reason=None, num_prompt_tokens=len(prompt), num_cached_tokens=0,
        queue_s=0.030, prefill_s=0.050,
    ))  # fmt: skip
    handoff = r.policy.cost.handoff
    assert handoff.samples == 1
    # 100 ms less the 30 ms queue and 50 ms prefill: a 20 ms sample, beside the 2 ms prior.
    expected = (2 * 0.002 * 0.97 + 0.020) / (2 * 0.97 + 1)
    assert abs(handoff.seconds - expected) < 1e-12
