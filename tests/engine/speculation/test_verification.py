"""Verification of speculative drafts (verification.py) at fixed synthetic prefixes: greedy keeps
the target's argmax; rejection sampling emits each token with the target's filtered
distribution (temperature, top-k, top-p) whether the draft's q is a point mass or a full
distribution: chi-square over 20k draws, p-value printed."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding.sampler import Sampler, filtered_probs
from pdserve.engine.speculation.verification import verify

VOCAB = 10
DRAWS = 20_000
MIN_P_VALUE = 1e-3  # the tests are seeded: a fixed p-value, failing only on a real bias


def target_logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 1.5


FILTERS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=1.3, top_p=0.7),
}


def assert_distributed_as(observed: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """Chi-square goodness of fit of token counts to a distribution; tokens it excludes must
    never occur."""
    support = expected > 0
    assert observed[~support].sum() == 0, f"{label}: filtered tokens emitted"
    total = observed.sum()
    assert total >= 1000, f"{label}: only {total} draws"
    exp = expected[support].double()
    exp = exp / exp.sum() * total.double()
    result = chisquare(observed[support].double().numpy(), exp.numpy())
    print(f"{label}: {int(total)} draws, chi-square p-value {result.pvalue:.4f}")
    assert result.pvalue > MIN_P_VALUE, f"{label}: p-value {result.pvalue}"


@pytest.mark.parametrize("draft_kind", ["point_mass", "full_q"])
@pytest.mark.parametrize("name", sorted(FILTERS))
def test_rejection_sampling_preserves_the_target_distribution(name, draft_kind):
    params = FILTERS[name]
    logits = target_logits(3)  # 2 drafts: rows judge draft 1, draft 2, then the next token
    p = filtered_probs(logits, [params] * 3)
    gen = torch.Generator().manual_seed(1)
    if draft_kind == "full_q":  # each draw's drafts drawn from q
        q = torch.softmax(torch.randn(2, VOCAB, generator=gen), dim=-1)
        drafts = torch.stack([torch.multinomial(q[i], DRAWS, True, generator=gen) for i in (0, 1)])
        drafts, q = drafts.T, q.expand(DRAWS, 2, VOCAB)
    else:  # a fixed guess: the second most likely token, then the most likely
        q = None
        guess = [int(p[0].argsort(descending=True)[1]), int(p[1].argmax())]
        drafts = torch.tensor([guess] * DRAWS)
    out = verify(logits.expand(DRAWS, 3, VOCAB), drafts, q, [params] * DRAWS, [[gen] * 3] * DRAWS)
    first = torch.bincount(torch.tensor([v.token_ids[0] for v in out]), minlength=VOCAB)
    # The second token exists where the first draft was accepted: it follows row 1.
    after = [v.token_ids[1] for v in out if v.num_accepted >= 1]
    second = torch.bincount(torch.tensor(after, dtype=torch.int64), minlength=VOCAB)
    label = f"{name}/{draft_kind}"
    assert_distributed_as(first, p[0], f"{label} token 1")
    assert_distributed_as(second, p[1], f"{label} token 2 after an accepted draft")
    accepted = sum(v.num_accepted for v in out) / (2 * DRAWS)
    print(f"{label}: acceptance rate {accepted:.3f}")


def greedy_verify(logits: torch.Tensor, draft: list[int], params=None):
    params = params or SamplingParams()
    d = len(draft)
    gens = [[torch.Generator()] * (d + 1)]
    drafts = torch.tensor([draft], dtype=torch.int64).view(1, d)
    return verify(logits[None, : d + 1], drafts, None, [params], gens)[0]


def test_greedy_accepts_while_the_argmax_agrees():
    logits = torch.zeros(4, VOCAB)
    logits[0, 3] = logits[1, 5] = logits[2, 2] = logits[3, 8] = 1.0
    out = greedy_verify(logits, [3, 5, 7])
    assert out.token_ids == [3, 5, 2] and out.num_accepted == 2
    out = greedy_verify(logits, [3, 5, 2])
    assert out.token_ids == [3, 5, 2, 8] and out.num_accepted == 3  # the bonus token
    out = greedy_verify(logits, [4])
    assert out.token_ids == [3] and out.num_accepted == 0
    assert greedy_verify(torch.zeros(1, VOCAB), []).token_ids == [0]  # ties: the lowest id


def test_logprobs_are_the_samplers():
    logits = target_logits(3)
    params = SamplingParams(logprobs=True)
    out = greedy_verify(logits, logits.argmax(-1)[:2].tolist(), params)
    want = torch.log_softmax(logits, -1).max(-1).values.tolist()
    assert out.logprobs == pytest.approx(want)
    tokens, logprobs = Sampler()(logits[:1], [params], [0])
    assert (out.token_ids[0], out.logprobs[0]) == (tokens[0], pytest.approx(logprobs[0]))


def test_seeded_verification_is_reproducible():
    logits = target_logits(5)[None]
    params = SamplingParams(temperature=1.0, seed=3)
    sampler = Sampler()
    drafts = torch.tensor([[1, 2, 3, 4]])
    runs = []
    for _ in range(2):
        gens = [[sampler.generator_for(params, 10 + n) for n in range(5)]]
        runs.append(verify(logits, drafts, None, [params], gens))
    assert runs[0] == runs[1]


def test_mixed_greedy_and_sampled_rows():
    logits = target_logits(3).expand(2, 3, VOCAB)
    best = logits[0].argmax(-1)
    drafts = best[:2].expand(2, 2)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)]  # top-1 = greedy
    gens = [[torch.Generator()] * 3] * 2
    out = verify(logits, drafts, None, params, gens)
    assert out[0].token_ids == out[1].token_ids == best.tolist()
