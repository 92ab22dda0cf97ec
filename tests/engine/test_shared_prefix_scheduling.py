"""Requests queued together that share a prefix compute it once, with unchanged outputs."""

from __future__ import annotations

from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts


def run(engine, prompts):
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    outputs = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))], engine.stats()


def test_a_prefix_shared_by_queued_requests_is_computed_once(make_engine):
    shared = random_prompts([64], seed=3)[0]
    tails = random_prompts([5, 7, 9, 6], seed=4)
    prompts = [shared + tail for tail in tails]
    outputs, stats = run(make_engine(max_num_batched_tokens=512), prompts)
    assert stats["prefill_tokens_computed"] == 64 + sum(len(t) for t in tails)
    # The same requests one at a time (no sharing decisions at all) give the same tokens.
    alone = [run(make_engine(), [p])[0][0] for p in prompts]
    assert outputs == alone


def test_without_prefix_caching_nothing_waits(make_engine):
    shared = random_prompts([32], seed=5)[0]
    prompts = [shared + [7, 8], shared + [9, 10]]
    _, stats = run(make_engine(enable_prefix_caching=False), prompts)
    assert stats["prefill_tokens_computed"] == sum(len(p) for p in prompts)
