"""The sampler's draws (unseeded: one uniform per row through the kept tokens' cumulative
distribution; seeded: Gumbel-max with each row's own noise) follow the distribution the
filters define, `filtered_probs`, whichever way the kept tokens
were found: the vocabulary unsorted (no filter), the top k, the nucleus among the best
NUCLEUS_CANDIDATES, or the whole row sorted when a nucleus reaches past them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding import sampler as sampler_module
from pdserve.engine.decoding.sampler import Sampler, filtered_probs, kept_tokens

VOCAB = 300
DRAWS = 6000
MIN_P_VALUE = 1e-3  # a correct sampler fails one check in a thousand runs


def row(scale: float, seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


# (logits scale, params): peaked rows keep few tokens, flat ones many.
CASES = {
    "temperature": (2.0, SamplingParams(temperature=0.9)),
    "top_k": (1.0, SamplingParams(temperature=1.0, top_k=7)),
    "top_p, nucleus among the candidates": (3.0, SamplingParams(temperature=1.0, top_p=0.6)),
    "top_p, nucleus past them": (0.3, SamplingParams(temperature=1.0, top_p=0.9)),
    "top_k and top_p": (1.0, SamplingParams(temperature=1.5, top_k=40, top_p=0.8)),
    "min_p, cut among the candidates": (3.0, SamplingParams(temperature=1.0, min_p=0.05)),
    "min_p, cut past them": (0.3, SamplingParams(temperature=1.0, min_p=0.3)),
    "top_p and min_p": (1.0, SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1)),
}


@pytest.fixture(autouse=True)
def few_candidates(monkeypatch):
    """16 candidates of 300 tokens: both ways of finding a nucleus occur at this size."""
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 16)


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_filtered_distribution(case):
    scale, params = CASES[case]
    logits = row(scale, seed=len(case)).repeat(DRAWS, 1)
    tokens, _ = Sampler(seed=0)(logits, [params] * DRAWS, [0] * DRAWS)
    assert_follows(tokens, logits, params, case)


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_draws_follow_the_filtered_distribution(case):
    """Gumbel-max draws, each row its own seed (so its own noise)."""
    scale, params = CASES[case]
    logits = row(scale, seed=len(case)).repeat(DRAWS, 1)
    seeded = [dataclasses.replace(params, seed=s) for s in range(DRAWS)]
    tokens, _ = Sampler()(logits, seeded, [3] * DRAWS)
    assert_follows(tokens, logits, params, f"seeded {case}")


def assert_follows(tokens: list[int], logits: torch.Tensor, params, case: str) -> None:
    observed = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = filtered_probs(logits[:1], [params])[0].double()
    support = expected > 0
    assert observed[~support].sum() == 0, "a filtered token was drawn"
    # Tokens expected fewer than 5 times are pooled: chi-square needs counts of 5 or more.
    exp = expected * DRAWS
    small = support & (exp < 5)
    obs_bins = torch.cat([observed[support & ~small], observed[small].sum()[None]])
    exp_bins = torch.cat([exp[support & ~small], exp[small].sum()[None]])
    keep = exp_bins > 0
    result = chisquare(
        obs_bins[keep].numpy(), exp_bins[keep].numpy() / exp_bins[keep].sum().item() * DRAWS
    )
    assert result.pvalue > MIN_P_VALUE, f"{case}: p-value {result.pvalue}"


def test_kept_tokens_are_the_filters_own_in_one_batch(monkeypatch):
    """Rows of several kinds together: each row's kept tokens and probabilities are those of
    the whole rows sorted, whether found among the candidates (the largest top k here, 40), in
    the sorted rows when one row's nucleus reaches past them, or in vocabulary order
    unfiltered."""
    cases = list(CASES.values())
    logits = torch.stack([row(scale, seed=i) for i, (scale, _) in enumerate(cases)])
    params = [p for _, p in cases]
    for batch, width in (([1, 2, 4], 40), ([1, 2, 3, 4], VOCAB), ([0], VOCAB)):
        rows, rules = logits[batch], [params[i] for i in batch]
        probs, ids = kept_tokens(rows, rules)
        assert probs.shape[-1] == width
        with monkeypatch.context() as m:  # no candidates: every filtered row sorted whole
            m.setattr(sampler_module, "NUCLEUS_CANDIDATES", VOCAB)
            full, order = kept_tokens(rows, rules)
        for r in range(len(batch)):
            kept = probs[r] > 0
            expected = {int(t): float(p) for t, p in zip(order[r], full[r], strict=True) if p > 0}
            got = {int(t): float(p) for t, p in zip(ids[r][kept], probs[r][kept], strict=True)}
            assert got.keys() == expected.keys()
            assert all(abs(got[t] - expected[t]) < 1e-6 for t in got)


def test_the_nucleus_search_falls_back_to_the_sorted_row():
    flat = row(0.3, seed=1)[None]
    params = [SamplingParams(temperature=1.0, top_p=0.9)]
    probs, _ = kept_tokens(flat, params)
    assert probs.shape[-1] == VOCAB  # 16 candidates held less than 0.9 of the mass
    peaked = row(3.0, seed=1)[None]
    probs, _ = kept_tokens(peaked, [SamplingParams(temperature=1.0, top_p=0.6)])
    assert probs.shape[-1] == 16


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    logits = row(1.0, seed=3)
    alone, _ = Sampler(seed=1)(logits[None], [params], [5])
    others = [SamplingParams(temperature=0.7, top_k=3)] * 3 + [params]
    crowded, _ = Sampler(seed=2)(
        torch.stack([row(2.0, seed=9)] * 3 + [logits]), others, [0, 1, 2, 5]
    )
    assert alone[0] == crowded[-1]
