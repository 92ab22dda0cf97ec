"""The search's estimate of a split under a router that may prefill locally (`auto`, the
field's rules): the decode workers can serve as colocated ones, so its ceiling (16x the
estimate) must not stop the search below what colocated serving reaches."""

from __future__ import annotations

from pdserve.planner.probe import Split
from pdserve.planner.search import WorkerRates, split_estimate

# Code completion's bounds for one 8B H100 worker (worker_rates): the prefill pool is slow.
CODE = WorkerRates(prefill=139.8, decode=755.7, colocated=134.8)


def test_auto_is_bounded_by_its_decode_workers_serving_colocated_plus_its_prefill_pool() -> None:
    split = Split(1, 7)
    assert split_estimate(CODE, split, "always") == 139.8  # the one prefill worker's prompts
    for mode in ("auto", "threshold:16", "conditional:1000:2"):
        estimate = split_estimate(CODE, split, mode)
        assert estimate == 7 * 134.8 + 139.8
        assert estimate > split_estimate(CODE, Split(0, 8), "never") * 7 / 8
