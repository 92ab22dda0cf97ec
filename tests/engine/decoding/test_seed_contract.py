"""The seed contract (decoding/sampler.py, speculation/verification.py): a seeded request's k-th token is a function of
(seed, k, its own filtered distribution) only. So in one engine a seeded temperature-only,
top-k, top-p, top-k + top-p, min-p or top-p + min-p request gives the same tokens alone and batched with every other
kind; a speculating engine (prompt lookup or a draft model, switch-off on or off) gives the
plain engine's tokens, run after run; a continuation after a retry (`seed_offset`) on a
speculating engine gives the rest of the uninterrupted run; and choice i of a seeded n-request
under a draft model equals a single request with seed + i."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding import sampler as sampler_module
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.draft_of import write_draft_of
from tests.engine.conftest import random_prompts

MAX_TOKENS = 20
BASE = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
KINDS = {
    "temperature": dataclasses.replace(BASE, temperature=0.9, seed=1),
    "top_k": dataclasses.replace(BASE, temperature=1.0, top_k=12, seed=2),
    "top_p": dataclasses.replace(BASE, temperature=0.6, top_p=0.8, seed=3),
    "top_k_top_p": dataclasses.replace(BASE, temperature=1.2, top_k=40, top_p=0.9, seed=4),
    "min_p": dataclasses.replace(BASE, temperature=1.0, min_p=0.1, seed=6),
    "top_p_min_p": dataclasses.replace(BASE, temperature=0.9, top_p=0.95, min_p=0.05, seed=7),
}
# Batched with the seeded kinds too: requests that promise no stream.
UNSEEDED = {
    "greedy": dataclasses.replace(BASE, temperature=0.0),
    "unseeded": dataclasses.replace(BASE, temperature=1.0, top_p=0.95),
}


@pytest.fixture(scope="module")
def draft_dir(tiny_dir, tmp_path_factory):
    """The tiny model's first layer (of two), embedding, norm and LM head."""
    return write_draft_of(tiny_dir, tmp_path_factory.mktemp("draft"), 1)[0]


def engine(tiny_dir, method: str | None = None, draft=None, min_acceptance=0.4) -> LLMEngine:
    settings = dict(model=str(tiny_dir), block_size=4, num_kv_blocks=256)
    if method is not None:
        settings["speculative"] = SpeculativeConfig(
            method=method,
            draft_model=None if draft is None else str(draft),
            num_speculative_tokens=4,
            min_acceptance=min_acceptance,
        )
    return LLMEngine(EngineConfig(**settings))


def repetitive_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds something to propose."""
    return [p * 4 for p in random_prompts([5] * count, seed=21)]


@pytest.mark.parametrize("candidates", [1024, 8], ids=["vocabulary-sorted", "among-candidates"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_seeded_kind_alone_equals_it_batched_with_every_other_kind(
    tiny_dir, monkeypatch, kind, candidates
):
    """8 candidates of 512 tokens: top-p's nucleus is found among them or in the sorted row."""
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", candidates)
    everyone = {**KINDS, **UNSEEDED}
    prompts = dict(zip(everyone, random_prompts([7] * len(everyone), seed=5), strict=True))
    [alone] = engine(tiny_dir).generate([prompts[kind]], KINDS[kind])
    batched = engine(tiny_dir).generate(list(prompts.values()), list(everyone.values()))
    assert batched[list(everyone).index(kind)] == alone


SPECULATING = [
    ("ngram", 0.4),
    ("ngram", 0.0),
    ("draft", 0.4),
    ("draft", 0.0),
]


@pytest.mark.parametrize(("method", "min_acceptance"), SPECULATING)
def test_a_speculating_engine_gives_the_plain_engines_seeded_tokens(
    tiny_dir, draft_dir, method, min_acceptance
):
    prompts = repetitive_prompts(len(KINDS))
    params = list(KINDS.values())
    plain = engine(tiny_dir).generate(prompts, params)
    for _ in range(3):
        spec = engine(tiny_dir, method, draft_dir if method == "draft" else None, min_acceptance)
        assert spec.generate(prompts, params) == plain
        stats = spec.stats()
        assert stats["spec_verify_steps"] > 0, stats
        # A draft model's drafts race the target's noise and are accepted often; prompt
        # lookup's are accepted with the target's p(x), a few percent on the tiny model, so
        # whether one of its few is accepted is chance (the accepted path is the same code).
        if method == "draft":
            assert stats["spec_accepted_tokens"] > 0, stats


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_retried_seeded_request_continues_the_speculating_run(tiny_dir, draft_dir, method):
    draft = draft_dir if method == "draft" else None
    prompt = repetitive_prompts(1)[0]
    params = KINDS["top_k"]
    [whole] = engine(tiny_dir, method, draft).generate([prompt], params)
    for done in (1, 6, 13):
        rest = dataclasses.replace(params, max_tokens=MAX_TOKENS - done, seed_offset=done)
        [tail] = engine(tiny_dir, method, draft).generate([prompt + whole[:done]], rest)
        assert tail == whole[done:], done


@pytest.mark.parametrize("length", [9, 12], ids=["partial-last-block", "block-boundary"])
def test_seeded_choice_i_under_a_draft_model_equals_seed_plus_i(tiny_dir, draft_dir, length):
    prompt = random_prompts([length], seed=3)[0]
    params = dataclasses.replace(KINDS["temperature"], n=3)
    spec = engine(tiny_dir, "draft", draft_dir, min_acceptance=0.0)
    spec.add_request("r", prompt, params)
    choices: dict[int, list[int]] = {}
    while spec.has_unfinished():
        for out in spec.step():
            choices.setdefault(out.index, []).extend(out.new_token_ids)
    assert spec.stats()["spec_accepted_tokens"] > 0
    for i in range(3):
        single = dataclasses.replace(params, n=1, seed=params.seed + i)
        [alone] = engine(tiny_dir, "draft", draft_dir, min_acceptance=0.0).generate(
            [prompt], single
        )
        assert choices[i] == alone, i
