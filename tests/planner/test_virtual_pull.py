"""A peer pull in the simulated cluster (pdserve/planner/virtual_pull.py): the second turn of a
conversation, sent by round_robin to the sim worker without the first, pulls the first turn's
prefix from the holder over the deployment's link when the router's cost model prices the pull
under the recompute, and computes only the rest; the push is recorded as the holder's transfer,
and no block stays pinned or used."""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.workload import ProbeRequest

BLOCK = 16
FIRST = [3 + i % 400 for i in range(20 * BLOCK)]  # 20 full blocks
SECOND = FIRST + [7] * 40  # the next turn: the first's prompt and 40 more tokens


def serve_two_turns(link_gbs: float | None):
    """Both turns on 2 colocated sim H100 workers; `link_gbs`: what the routers' cost model
    has learned of the link (None: its prior)."""

    def teach_the_link(cluster):
        if link_gbs is not None:
            for routing in cluster.routers:
                for _ in range(8):
                    routing.policy.cost.observe_transfer(64 << 20, (64 << 20) / (link_gbs * 1e9))
        return None

    deployment = Deployment("llama-3.1-8b", num_kv_blocks=256, block_size=BLOCK)
    probes = [ProbeRequest(0, FIRST, 4, 0.0), ProbeRequest(1, SECOND, 4, 10.0)]
    router = RouterConfig(policy="round_robin", disaggregate="never", peer_pull=True)
    _, runs = run_probe(
        deployment, Split(0, 2), probes, 1.0, SLO(1e4, 1e4), router,
        stop_when_certain=False, index_lag_s=0.001, attach=teach_the_link,
    )  # fmt: skip
    assert all(r.record.ok for r in runs)
    return runs


def test_the_second_turn_pulls_the_first_turns_prefix_over_the_link():
    first, second = serve_two_turns(link_gbs=50.0)
    holder, puller = first.route.decode_worker, second.route.decode_worker
    assert puller != holder and second.route.peer_pull.holder == holder
    workers = second.cluster.workers
    pulled = workers[puller].engine.stats()
    assert pulled["prefix_peer_hit_tokens"] == len(FIRST)
    assert (pulled["peer_pulls_committed"], pulled["peer_pulls_fallen_back"]) == (1, 0)
    puller_stats = workers[puller].stats()
    assert puller_stats.prefill_tokens == len(SECOND) - len(FIRST)
    assert puller_stats.prefill_steps >= 1  # the router's measured step counts prompt steps
    pushed = workers[holder].stats()
    assert pushed.transfer_bytes == 20 * workers[holder].engine.bytes_per_block
    assert (
        pushed.transfer_seconds
        == pushed.transfer_bytes / second.cluster.deployment.link_bytes_per_s
    )
    for worker in workers.values():  # nothing pinned or held once both turns ended
        assert worker.engine.stats()["num_used_blocks"] == 0


def test_a_pull_the_cost_model_prices_above_the_recompute_is_not_made():
    # The prior transfer line (1 GB/s + 2 ms) against an H100's prefill of 20 blocks: no pull.
    first, second = serve_two_turns(link_gbs=None)
    assert second.route.peer_pull is None
    assert second.cluster.workers[second.route.decode_worker].stats().prefill_tokens == len(SECOND)
