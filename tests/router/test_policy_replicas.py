"""Router replicas side by side: their policies must not pick alike (random picks, where the
rotations start, least_loaded's ties), or replicas that each see only their own requests send
to the same workers together."""

from __future__ import annotations

from collections import Counter

from pdserve.config import RouterConfig
from router.estimates import RoutingRequest, WorkerLoad
from router.policy import RoutingPolicy

REQUEST = RoutingRequest(prompt_tokens=1024, max_tokens=64, block_size=16, bytes_per_block=1)
WORKERS = [WorkerLoad(f"d{i}", num_blocks=4096, num_free_blocks=4096) for i in range(16)]


def decode_picks(policy: RoutingPolicy, count: int) -> list[str]:
    """`count` decisions on the same idle workers (each sees none of the others' requests)."""
    return [policy.decide(REQUEST, [], WORKERS).decode_worker for _ in range(count)]


def replicas(name: str, count: int, seeds=None) -> list[RoutingPolicy]:
    config = RouterConfig(policy=name, disaggregate="never")
    return [RoutingPolicy(config, seed=s) for s in (seeds or range(count))]


def test_random_picks_differ_between_seeds_and_repeat_for_one() -> None:
    one, other, again = replicas("random", 3, seeds=[0, 1, 0])
    assert decode_picks(one, 64) != decode_picks(other, 64)
    assert decode_picks(again, 64) == decode_picks(replicas("random", 1)[0], 64)
    # Unseeded (a real router's default): from system entropy, so two never repeat each other.
    a, b = replicas("random", 2, seeds=[None, None])
    assert decode_picks(a, 64) != decode_picks(b, 64)


def interleaved(policies: list[RoutingPolicy], count: int) -> list[str]:
    """Request k on replica k mod len(policies), as the load balancer in front spreads them."""
    return [decode_picks(policies[k % len(policies)], 1)[0] for k in range(count)]


def test_round_robin_replicas_spread_when_their_turns_interleave() -> None:
    picks = interleaved(replicas("round_robin", 4), 256)
    # Any window of one request per worker reaches most workers; in lockstep the four
    # replicas sent each window to 4 workers, 4 requests each.
    for start in range(0, len(picks) - len(WORKERS) + 1):
        window = Counter(picks[start : start + len(WORKERS)])
        assert len(window) >= len(WORKERS) // 2, (start, window)
    assert Counter(picks) == {w.worker_id: 16 for w in WORKERS}  # and evenly in all


def test_least_loaded_breaks_exact_ties_in_rotation() -> None:
    # Idle workers whose caches fill different parts of their pools (as every replica reads
    # them in the same stats): the loads tie, and do not change between decisions.
    idle = [WorkerLoad(f"d{i}", num_blocks=4096, num_free_blocks=4096 - 100 * i) for i in range(16)]
    policy = replicas("least_loaded", 1)[0]
    picks = [policy.decide(REQUEST, [], idle).decode_worker for _ in range(32)]
    assert Counter(picks) == {w.worker_id: 2 for w in idle}
    first_picks = [p.decide(REQUEST, [], idle).decode_worker for p in replicas("least_loaded", 8)]
    assert len(set(first_picks)) > 1  # by name or free blocks, all eight sent theirs to d0


def test_least_loaded_still_prefers_the_least_loaded() -> None:
    busy = [WorkerLoad(w.worker_id, num_running=2, num_blocks=4096, num_free_blocks=4096)
            for w in WORKERS[:-1]]  # fmt: skip
    idle = WorkerLoad("idle", num_blocks=4096, num_free_blocks=4096)
    for policy in replicas("least_loaded", 4):
        assert policy.decide(REQUEST, [], [*busy, idle]).decode_worker == "idle"
