"""Beams and n choices over prompts long enough that their forks attend as shared-prefix
families (gpu_step/attention_batch.py, when decode attention gathers the KV blocks): still
transformers' beams and scores, still a single request's seeded tokens."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.engine import LLMEngine
from pdserve.engine.gpu_step import attention_batch
from tests.engine.conftest import random_prompts
from tests.engine.decoding import test_beam_search
from tests.engine.decoding.test_beam_search import beam_cases, run_engine
from tests.engine.decoding.test_n_choices import SAMPLED, assert_all_free, run_choices, single
from tests.models.test_llama_matches_transformers import VOCAB

models = test_beam_search.models  # the fixture: Llama, Mistral and Qwen2 test models

# Block size 4: 6-10 prompt blocks shared by the beams, 7 new tokens at most 2 blocks each.
LONG_PROMPTS = random_prompts([24, 29, 40, 33], seed=41, vocab=VOCAB)


@pytest.fixture
def families_seen(monkeypatch) -> list[int]:
    """Counts the pseudo-sequences attention_batch builds (the real builder runs)."""
    seen: list[int] = []
    build = attention_batch._shared_prefix

    def counting(families, *args):
        seen.append(len(families))
        return build(families, *args)

    monkeypatch.setattr(attention_batch, "_shared_prefix", counting)
    return seen


def gathering(engine: LLMEngine) -> LLMEngine:
    """`engine` with decode attention gathering the KV blocks, where families apply: read in
    place (the CPU kernel, models/native_attention.py), a family's shared blocks are not
    copied at all, so no families are formed."""
    engine.runner.reads_kv_in_place = False
    return engine


def test_beams_attending_as_families_equal_transformers(models, families_seen):
    hf, config = models
    width, n, length_penalty, early_stopping = 4, 2, 1.0, False
    engine = gathering(LLMEngine(config))
    requests, expected = beam_cases(hf, LONG_PROMPTS, 7, width, n, length_penalty, early_stopping)
    got = run_engine(engine, requests)
    assert families_seen and max(families_seen) == len(LONG_PROMPTS)
    for rid, (tokens, scores) in expected.items():
        outs = got[rid]
        assert [outs[i].new_token_ids for i in range(n)] == tokens, rid
        assert [outs[i].score for i in range(n)] == pytest.approx(scores, abs=1e-4), rid
    assert engine.stats()["num_used_blocks"] == 0
    engine.block_manager.check_invariants()


def test_seeded_choices_attending_as_a_family_equal_single_requests(make_engine, families_seen):
    prompt = random_prompts([30], seed=5)[0]
    params = dataclasses.replace(SAMPLED, n=3)
    engine = gathering(make_engine())
    got = run_choices(engine, "r", prompt, params)
    assert families_seen
    for i in range(3):
        alone = single(make_engine, prompt, dataclasses.replace(SAMPLED, seed=SAMPLED.seed + i))
        assert got[i] == [alone, "length"], i
    assert_all_free(engine)
