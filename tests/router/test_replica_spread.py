"""Router replicas read the same polled loads and each sees only its own routes until the next
poll. The cost policy's pick among workers that differ only by a few running decodes must not
be the same in every replica: four replicas sending four cold prompts to the one idle worker of
16 made them wait behind each other (311-414 ms instead of 107; docs/benchmarks/routing.md,
"Many tenants, sixth part"). One router, which sees all its routes, takes the idle worker."""

from __future__ import annotations

from pdserve.config import RouterConfig
from router.cost_model import CostModel
from router.estimates import RoutingRequest, WorkerLoad
from router.policy import RoutingPolicy

COLD = RoutingRequest(prompt_tokens=4160, max_tokens=64, block_size=16)
# The last poll: decode-0 idle, the others each decoding one request (16 workers, 2,048 blocks).
LOADS = [
    WorkerLoad(f"decode-{i}", num_running=0 if i == 0 else 1, num_blocks=2048,
               num_free_blocks=2048 if i == 0 else 1788)
    for i in range(16)
]  # fmt: skip


def measured() -> CostModel:
    """The lines the simulated 8B on an H100 teaches the router (fifth part: 6.0 ms + 25.2 us
    per prompt token; a decode step of 7-8 ms)."""
    cost = CostModel()
    for tokens in (512, 4160):
        cost.observe_prefill(tokens, 0.006 + 25.2e-6 * tokens, local=True)
    for batch in (1, 8):
        cost.observe_decode_step(batch, 0.0072 + 0.0001 * batch)
    return cost


def replicas(n: int, vectorised: bool = True) -> list[RoutingPolicy]:
    config = RouterConfig(policy="cost", disaggregate="never", router_replicas=n)
    return [RoutingPolicy(config, measured(), seed=k, vectorised=vectorised) for k in range(n)]


def test_replicas_do_not_all_send_a_cold_prompt_to_the_idle_worker() -> None:
    for vectorised in (True, False):
        picks = [p.decide(COLD, [], LOADS).decode_worker for p in replicas(4, vectorised)]
        assert len(set(picks)) > 1, picks


def test_one_router_sends_a_cold_prompt_to_the_idle_worker() -> None:
    """Alone, the router counts every request it routed since the poll: the idle worker's lead
    is real, and a cold prefix sent to a worker that is decoding makes its requests, and the
    warm turns arriving there, wait behind it (docs/benchmarks/routing.md, ninth part)."""
    for vectorised in (True, False):
        for seed in range(8):
            config = RouterConfig(policy="cost", disaggregate="never")
            policy = RoutingPolicy(config, measured(), seed=seed, vectorised=vectorised)
            assert policy.decide(COLD, [], LOADS).decode_worker == "decode-0"


def test_a_cached_prefix_still_decides_between_replicas() -> None:
    cached = {"decode-7": 256}  # the prompt's prefix is held by one busy worker
    picks = {p.decide(COLD, [], LOADS, cached_blocks=cached).decode_worker for p in replicas(4)}
    assert picks == {"decode-7"}


def test_a_worker_queueing_a_prompt_is_no_tie() -> None:
    """The wider tolerance spreads small differences (a few running decodes), not a queued
    cold prompt's wait of ~0.1 s."""
    loads = [
        WorkerLoad(w.worker_id, num_running=w.num_running, num_blocks=2048,
                   num_free_blocks=w.num_free_blocks,
                   num_waiting=0 if i < 2 else 1, waiting_prompt_tokens=0 if i < 2 else 4160)
        for i, w in enumerate(LOADS)
    ]  # fmt: skip
    picks = {p.decide(COLD, [], loads).decode_worker for p in replicas(8)}
    assert picks <= {"decode-0", "decode-1"}
