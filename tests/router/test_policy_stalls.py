"""The cost policy's price of a local prefill's stall against a remote prefill's TTFT: a TTFT
missed anywhere, one predicted near its SLO, a batch's TPOT breach (capped as a prediction,
uncapped where the decode worker's measured step says it is certain)."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.core.messages import WorkerStats
from router.cost_model import CostModel
from router.estimates import RoutingRequest, Weights
from router.policy import RoutingDecision, RoutingPolicy
from tests.router.test_policy import LONG, MiB, calibrated, worker


def test_a_prompt_that_misses_the_ttft_slo_anywhere_does_not_stall_a_decode_worker() -> None:
    # Costs as measured on a CPU: 768 tokens take ~2 s to prefill wherever they run, and the
    # 12 MiB of KV take ~0.3 s to move. The TTFT SLO (200 ms) is missed either way, so saving
    # the transfer is worth far less than keeping D's decodes (and its next requests) moving.
    cost = calibrated(intercept=0.05, per_token=2.5e-3)
    for _ in range(10):
        cost.observe_transfer(12 * MiB, 0.3)
    pol = RoutingPolicy(RouterConfig(ttft_slo_ms=200), cost)
    long_chat = RoutingRequest(
        prompt_tokens=768, max_tokens=8, block_size=16, bytes_per_block=MiB // 4
    )
    decision = pol.decide(long_chat, [worker("p0")], [worker("d0")])
    local = decision.estimates["local@d0"]
    assert decision.prefill_worker == "p0"
    assert local.ttft_s < decision.chosen.ttft_s  # local would be faster, but misses anyway
    # The TTFT miss is charged to no option; local's penalty is its stall's TPOT miss alone.
    assert decision.chosen.terms["slo_penalty"] == 0
    amortize = min(Weights().stall_amortize_tokens, long_chat.max_tokens)
    stalled_tpot_s = local.tpot_s + local.stall_s / amortize
    stall_miss = stalled_tpot_s / (RouterConfig().tpot_slo_ms / 1e3) - 1
    w = Weights()  # one request stalled: the newcomer the idle D would take meanwhile
    stalled = w.stall_newcomers
    assert local.terms["slo_penalty"] == w.slo_penalty * min(w.stall_miss_cap, stalled * stall_miss)
    assert stall_miss > 0
    # A short prompt on the same idle D meets the SLO locally and is still prefilled there.
    short = RoutingRequest(prompt_tokens=48, max_tokens=8, block_size=16, bytes_per_block=MiB // 4)
    assert pol.decide(short, [worker("p0")], [worker("d0")]).prefill_worker is None


@pytest.mark.parametrize("vectorised", [True, False])
def test_a_remote_prefill_predicted_just_under_the_ttft_slo_is_priced_as_a_likely_miss(vectorised):
    # The prefill worker's queue puts a remote TTFT at 0.93 s of a 1 s SLO; a local prefill
    # takes 0.26 s and stalls D's 24 decodes, whose TPOT stays far under 50 ms. Predictions
    # run short (70B rag: +0.28 s at p90, docs/benchmarks/simulation.md, session 9), so the
    # TTFT penalty starts 30% below the SLO: the request is prefilled locally, where with no
    # margin the stall's price sent it to the queue.
    cost, slos = calibrated(), RouterConfig(ttft_slo_ms=1000, tpot_slo_ms=50)
    decode = [worker("d0", num_running=24)]

    def prefilled_on(weights: Weights, queued_tokens: int) -> str | None:
        queued = [worker("p0", num_waiting=4, waiting_prompt_tokens=queued_tokens)]
        pol = RoutingPolicy(slos, cost, weights, vectorised=vectorised)
        return pol.decide(LONG, queued, decode).prefill_worker

    assert Weights().ttft_margin == 0.3
    assert prefilled_on(Weights(), 2400) is None
    assert prefilled_on(Weights(ttft_margin=0), 2400) == "p0"
    # Further from the SLO (0.72 s predicted, near the penalty's start) the queue still wins.
    assert prefilled_on(Weights(), 1600) == "p0"


@pytest.mark.parametrize("vectorised", [True, False])
def test_a_stall_that_breaks_a_batchs_tpot_slo_is_charged_for_every_request_it_stalls(vectorised):
    # D runs 28 decodes at ~18.7 ms a step against a 20 ms TPOT SLO; a 160-token local prefill
    # would push them all past it. The prefill worker's queue puts a remote TTFT at 0.82 s of a
    # 1 s SLO: a likely miss for one request. Charged as one request's miss, the batch's breach
    # lost to it (Weights.stall_miss_cap).
    pol = RoutingPolicy(RouterConfig(ttft_slo_ms=1000, tpot_slo_ms=20), calibrated(),
                        vectorised=vectorised)  # fmt: skip
    prompt = RoutingRequest(prompt_tokens=160, max_tokens=64, block_size=16, bytes_per_block=MiB)
    queued = worker("p0", num_waiting=4, waiting_prompt_tokens=3000)
    decision = pol.decide(prompt, [queued], [worker("d0", num_running=28)])
    assert decision.prefill_worker == "p0"
    assert 0.7 < decision.chosen.ttft_s < 1.0  # inside the SLO, past the penalty's margin
    local = decision.estimates["local@d0"]
    stalled_tpot_n = (local.tpot_s + local.stall_s / 32) / 0.020
    per_request = stalled_tpot_n - 1
    assert 0 < per_request < 0.05  # a small breach: charged once, it lost
    w = Weights()
    breach = min(w.stall_miss_cap, (28 + w.stall_newcomers) * per_request)
    assert local.terms["slo_penalty"] == pytest.approx(w.slo_penalty * breach)
    assert breach == w.stall_miss_cap  # 29 requests' breach: the cap
    # A remote TTFT predicted past the SLO costs more than the capped breach: local.
    longer = worker("p0", num_waiting=4, waiting_prompt_tokens=5000)
    assert pol.decide(prompt, [longer], [worker("d0", num_running=28)]).prefill_worker is None


def measured_step(cost: CostModel, worker_id: str, step_s: float) -> None:
    """Polls of a decode worker whose every step took `step_s` (CostModel.step_seconds)."""
    for poll in range(20):
        cost.observe_stats(WorkerStats(worker_id, "decode", epoch=1, prefill_steps=100 * poll,
                                       prefill_seconds=100 * poll * step_s))  # fmt: skip


@pytest.mark.parametrize("vectorised", [True, False])
def test_a_stall_the_decode_workers_measured_step_cannot_absorb_is_charged_uncapped(vectorised):
    # Three decode workers that look the same to the predicted step (28 decodes, ~18.7 ms
    # against an 18 ms TPOT SLO), a remote TTFT predicted past its SLO, and a 640-token prompt
    # whose local prefill stalls D ~0.17 s (2.7 ms over its 64 tokens). Where D's steps
    # measure 17 ms, the stall puts its batch 9% past the SLO: every request it pauses misses,
    # uncapped, and the prompt waits for the prefill worker. Where they measure 15.5 ms (1%
    # past: within the step's spread), 12 ms, or are not measured yet, the capped breach is a
    # prediction and the prompt stays local (70B rag at TPOT <= 18 ms and 70B chat at 20 ms,
    # docs/benchmarks/simulation.md, session 20).
    cost = calibrated()
    measured_step(cost, "busy", 0.017)
    measured_step(cost, "edge", 0.0155)
    measured_step(cost, "roomy", 0.012)
    pol = RoutingPolicy(RouterConfig(ttft_slo_ms=1000, tpot_slo_ms=18), cost,
                        vectorised=vectorised)  # fmt: skip
    prompt = RoutingRequest(prompt_tokens=640, max_tokens=64, block_size=16, bytes_per_block=MiB)
    queued = worker("p0", num_waiting=4, waiting_prompt_tokens=5000)

    def decide(decode_worker: str, **load) -> RoutingDecision:
        return pol.decide(prompt, [queued], [worker(decode_worker, num_running=28, **load)])

    busy = decide("busy")
    assert busy.prefill_worker == "p0" and busy.chosen.ttft_s > 1.0
    local = busy.estimates["local@busy"]
    stalled_tpot_n = (0.017 + local.stall_s / prompt.max_tokens) / 0.018
    w = Weights()
    own = local.tpot_s / 0.018 - 1  # this request's own TPOT overshoot, as on every option
    certain = (28 + w.stall_newcomers) * (stalled_tpot_n - 1)
    assert certain > 4 * w.stall_miss_cap
    assert local.terms["slo_penalty"] == pytest.approx(w.slo_penalty * (own + certain))
    assert w.tpot_noise < stalled_tpot_n - 1
    for kept in (decide("edge"), decide("roomy"), decide("unmeasured")):
        assert kept.prefill_worker is None
    # A hybrid D's every option stalls someone: the cap holds there.
    assert decide("busy", hybrid=True).prefill_worker is None
