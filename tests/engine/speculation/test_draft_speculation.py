"""Speculative decoding with a draft model (`--speculative draft`) in the engine: greedy output
is the non-speculative greedy output token for token for every k, batched with requests that
do not speculate, under preemption, with prefix-cache hits and on the decode side of a
disaggregated handoff (the draft computes the prompt's KV there); a draft identical to the
target has every proposal accepted; no blocks are left behind."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.draft_of import write_draft_of
from tests.engine.conftest import random_prompts
from tests.engine.test_disaggregation import handoff

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tiny_dir, tmp_path_factory):
    """The tiny model's first layer (of two), embedding, norm and LM head."""
    return write_draft_of(tiny_dir, tmp_path_factory.mktemp("draft"), 1)[0]


@pytest.fixture(scope="module")
def twin_dir(tiny_dir, tmp_path_factory):
    """A draft with all the target's layers: it proposes exactly the target's tokens."""
    return write_draft_of(tiny_dir, tmp_path_factory.mktemp("twin"), 2)[0]


def engine_for(model_dir, draft=None, k: int = 4, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), block_size=4, num_kv_blocks=128)
    settings.update(overrides)
    if draft is not None:  # never paused: every step verifies
        settings["speculative"] = SpeculativeConfig(
            method="draft", draft_model=str(draft), num_speculative_tokens=k, min_acceptance=0.0
        )
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([3, 9, 17, 30], seed=11)


@pytest.fixture(scope="module")
def expected(tiny_dir, prompts):
    return engine_for(tiny_dir).generate(prompts, GREEDY)


def assert_clean(engine: LLMEngine) -> dict:
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0, stats
    engine.block_manager.check_invariants()
    return stats


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equals_plain_greedy_for_every_k(tiny_dir, draft_dir, prompts, expected, k):
    engine = engine_for(tiny_dir, draft_dir, k)
    params = [GREEDY, dataclasses.replace(GREEDY, speculative=False), GREEDY, GREEDY]
    assert engine.generate(prompts, params) == expected
    stats = assert_clean(engine)
    assert stats["spec_verify_steps"] > 0, stats


def test_a_draft_equal_to_the_target_has_everything_accepted(tiny_dir, twin_dir, prompts, expected):
    engine = engine_for(tiny_dir, twin_dir, 4)
    assert engine.generate(prompts, GREEDY) == expected
    stats = assert_clean(engine)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats
    # 4 drafts + the target's token per verification: far fewer steps than tokens.
    assert stats["steps"] < MAX_TOKENS // 2


def test_preemption_in_a_tiny_pool(tiny_dir, draft_dir, prompts, expected):
    engine = engine_for(tiny_dir, draft_dir, 4, num_kv_blocks=24)
    assert engine.generate(prompts, GREEDY) == expected
    stats = assert_clean(engine)
    assert stats["num_preemptions"] > 0, stats


def test_prefix_cache_hits_reuse_the_draft_kv(tiny_dir, twin_dir, prompts, expected):
    engine = engine_for(tiny_dir, twin_dir, 4)
    first = engine.generate(prompts[3:], GREEDY)
    again = engine.generate(prompts[3:], GREEDY)
    assert first == again == expected[3:]
    assert engine.stats()["prefix_hit_tokens"] >= 28
    assert_clean(engine)


def test_decode_side_of_a_handoff_computes_the_drafts_prompt_kv(tiny_dir, twin_dir, prompts):
    prefill, decode = engine_for(tiny_dir), engine_for(tiny_dir, twin_dir, 4)
    got, _ = handoff(prefill, decode, "r", prompts[3], GREEDY)
    assert got == engine_for(tiny_dir).generate([prompts[3]], GREEDY)[0]
    stats = assert_clean(decode)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats


def test_seeded_sampling_with_a_draft_is_reproducible(tiny_dir, draft_dir, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=3, n=2, ignore_eos=True)
    runs = [engine_for(tiny_dir, draft_dir, 4).generate(prompts, params) for _ in range(2)]
    assert runs[0] == runs[1]
