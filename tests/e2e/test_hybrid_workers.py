"""`pdserve serve --hybrid`: every decode worker also prefills for the others. Under each
`--disaggregate` mode, requests served concurrently by two hybrid workers come out
token-identical to one engine's; a remote prefill never lands on its own decode worker, and no
block is left held."""

from __future__ import annotations

import random

import pytest
import ray

from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import (
    VOCAB_HIGH,
    VOCAB_LOW,
    all_workers_idle,
    reference_outputs,
)
from tests.e2e.test_role_switching import prompts_of, routes, run_batch


@pytest.fixture(scope="module")
def served(ray_cluster):
    from pdserve.app import BackgroundApp

    config = serve_config("grpc", prefill_workers=0, decode_workers=2)
    config.router.hybrid = True
    with BackgroundApp(config) as app:
        yield app


def test_hybrid_workers_are_listed_in_both_roles(served):
    pool = served.app.pool
    assert [w.worker_id for w in pool.of_role("prefill")] == ["decode-0", "decode-1"]
    assert [w.worker_id for w in pool.of_role("decode")] == ["decode-0", "decode-1"]
    assert {ray.get(w.actor.stats.remote()).role for w in pool.workers.values()} == {"hybrid"}


@pytest.mark.parametrize("mode", ["always", "auto", "never"])
def test_every_mode_serves_token_identical_on_hybrid_workers(served, stub, mode):
    policy = served.app.routing.policy
    policy.config.disaggregate = mode  # read at each decision
    try:
        answers = run_batch(stub, *prompts_of(10 + len(mode), 12))
    finally:
        policy.config.disaggregate = "always"
    remote = [t.disaggregated for t in (r[-1].timings for _, r in answers)]
    pairs = routes(answers)
    if mode == "always":  # every prefill on the other worker: both directions were used
        assert all(remote)
        assert set(pairs) == {("decode-0", "decode-1"), ("decode-1", "decode-0")}
    if mode == "never":
        assert not any(remote)
    # A remote prefill is never its own decode worker's (that one would be local).
    assert all(p != d for (p, d), far in zip(pairs, remote, strict=True) if far)
    assert all_workers_idle(served) == dict.fromkeys(served.app.pool.workers, 0)


def test_a_prompt_prefilled_on_a_peer_is_cached_on_both_workers(served, stub):
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(80)] for _ in range(4)]
    max_tokens = [12] * len(prompts)
    first = run_batch(stub, prompts, max_tokens)  # remote: the decode workers receive the KV
    policy = served.app.routing.policy
    policy.config.disaggregate = "never"
    try:
        again = run_batch(stub, prompts, max_tokens)
    finally:
        policy.config.disaggregate = "always"
    assert [tokens for tokens, _ in again] == reference_outputs(prompts, max_tokens)
    # Both workers hold each prompt (one computed it, the other received it): every repeat,
    # prefilled locally wherever it went, found it cached.
    assert all(r[-1].timings.disaggregated for _, r in first)
    assert all(r[-1].usage.cached_prompt_tokens >= 64 for _, r in again)
