"""Greedy generation of a mixed batch is identical to transformers token for token: plain,
with prefix-cache hits, with chunked prefill, and under preemption (a tiny KV pool)."""

from __future__ import annotations

import pytest

from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts
from tests.models.hf_reference import hf_greedy

LENGTHS = [1, 3, 4, 5, 9, 16, 23, 40, 61]  # >= 8 prompts; around and across block borders
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=1)


@pytest.fixture(scope="module")
def expected(hf_tiny, prompts):
    return hf_greedy(hf_tiny, prompts, MAX_TOKENS)


def test_batch_matches_transformers(make_engine, prompts, expected):
    engine = make_engine()
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.stats()["num_used_blocks"] == 0


@pytest.fixture(scope="module")
def extended(prompts):
    """Prompts that share all their full blocks but the last few tokens with `prompts`."""
    return [p + [7, 8, 9] for p in prompts]


def test_prefix_cache_hits_give_the_same_tokens(make_engine, hf_tiny, prompts, expected, extended):
    engine = make_engine()
    engine.generate(prompts, GREEDY)
    assert engine.stats()["prefix_hit_tokens"] == 0
    assert engine.generate(prompts, GREEDY) == expected  # full hits (but the last token)
    hits = engine.stats()["prefix_hit_tokens"]
    assert hits >= sum(len(p) - 4 for p in prompts)
    assert engine.generate(extended, GREEDY) == hf_greedy(hf_tiny, extended, MAX_TOKENS)
    assert engine.stats()["prefix_hit_tokens"] > hits


def test_chunked_prefill_gives_the_same_tokens(make_engine, prompts, expected):
    engine = make_engine(max_num_batched_tokens=7)  # every prompt > 7 tokens takes chunks
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.stats()["num_used_blocks"] == 0


def test_no_chunking_and_no_prefix_cache(make_engine, prompts, expected):
    engine = make_engine(enable_chunked_prefill=False, enable_prefix_caching=False)
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.stats()["prefix_hit_tokens"] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_gives_the_same_tokens(make_engine, prompts, expected, caching):
    # 20 blocks of 4 tokens hold the longest request (61 + 16 tokens) but not the batch.
    engine = make_engine(num_kv_blocks=20, enable_prefix_caching=caching)
    assert engine.generate(prompts, GREEDY) == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_max_num_seqs_limits_the_batch(make_engine, prompts, expected):
    engine = make_engine(max_num_seqs=2)
    for p in prompts:
        engine.add_request(str(len(p)), p, GREEDY)
    outputs: dict[str, list[int]] = {str(len(p)): [] for p in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        assert engine.stats()["num_running"] <= 2
    assert [outputs[str(len(p))] for p in prompts] == expected
    assert engine.stats()["num_used_blocks"] == 0
