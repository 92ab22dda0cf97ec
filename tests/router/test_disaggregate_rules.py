"""The field's disaggregation rules as `--disaggregate` modes: llm-d's threshold on uncached
tokens and Dynamo's conditional rule (uncached length and prefill queue), and their parsing."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.config_fields import ConfigError
from pdserve.disaggregate_modes import DisaggregateMode, parse_disaggregate
from router.estimates import RoutingRequest, WorkerLoad
from router.policy import RoutingPolicy

MiB = 1 << 20


def request(tokens: int) -> RoutingRequest:
    return RoutingRequest(prompt_tokens=tokens, max_tokens=64, block_size=16, bytes_per_block=MiB)


def worker(worker_id: str, **load) -> WorkerLoad:
    return WorkerLoad(worker_id, num_blocks=4096, num_free_blocks=4096, **load)


@pytest.mark.parametrize("vectorised", [True, False])
def test_threshold_rule_prefills_remotely_above_n_uncached_tokens(vectorised: bool) -> None:
    policy = RoutingPolicy(RouterConfig(disaggregate="threshold:16"), vectorised=vectorised)
    busy_prefill = [worker("p0", num_waiting=50, waiting_prompt_tokens=60_000)]
    idle_decode = [worker("d0")]
    # 17 uncached tokens: remote, even to a swamped prefill worker with an idle decode worker
    # beside it (what `auto` would never do: the rule looks at the prompt alone).
    assert policy.decide(request(17), busy_prefill, idle_decode).prefill_worker == "p0"
    assert policy.decide(request(16), busy_prefill, idle_decode).prefill_worker is None
    # A cached prefix on the decode side counts: of 1024 tokens, 62 blocks (992) held leave
    # 32 to compute, 63 blocks leave 16.
    held = {"d0": 62}
    assert policy.decide(request(1024), busy_prefill, idle_decode, held).prefill_worker == "p0"
    held = {"d0": 63}
    assert policy.decide(request(1024), busy_prefill, idle_decode, held).prefill_worker is None


@pytest.mark.parametrize("vectorised", [True, False])
def test_conditional_rule_also_bounds_the_prefill_queue(vectorised: bool) -> None:
    policy = RoutingPolicy(RouterConfig(disaggregate="conditional:512:2"), vectorised=vectorised)
    decode = [worker("d0", num_running=32)]
    # p1's queue is 5,000 tokens long: no tie with p0 within the cost policy's tolerance.
    short_queue = [
        worker("p0", num_waiting=1),
        worker("p1", num_waiting=5, waiting_prompt_tokens=5000),
    ]
    long_queues = [worker("p0", num_waiting=2), worker("p1", num_waiting=5)]
    assert policy.decide(request(513), short_queue, decode).prefill_worker == "p0"
    assert policy.decide(request(512), short_queue, decode).prefill_worker is None
    assert policy.decide(request(4096), long_queues, decode).prefill_worker is None


def test_rules_prefill_locally_without_a_prefill_worker() -> None:
    policy = RoutingPolicy(RouterConfig(disaggregate="threshold:16"))
    sick = [worker("p0", healthy=False)]
    decision = policy.decide(request(4096), sick, [worker("d0")])
    assert decision.accepted and decision.prefill_worker is None


def test_modes_parse() -> None:
    assert parse_disaggregate("auto") == DisaggregateMode("auto")
    assert parse_disaggregate("threshold:16") == DisaggregateMode("threshold", 16)
    assert parse_disaggregate("conditional:512:2") == DisaggregateMode("conditional", 512, 2)


@pytest.mark.parametrize(
    "spec", ["sometimes", "auto:1", "threshold", "threshold:x", "threshold:-1",
             "conditional:512", "conditional:512:0", "always:3"],
)  # fmt: skip
def test_bad_modes_name_the_field(spec: str) -> None:
    with pytest.raises(ConfigError, match="disaggregate"):
        RouterConfig(disaggregate=spec)
