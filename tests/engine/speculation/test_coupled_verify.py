"""The coupled draw of seeded rows (verification.py): every emitted token is the plain sampler's
draw of its position, so tokens follow the target's filtered distribution whatever the drafts
(a fixed guess, drafts drawn from q, or drafts racing q with the target's own Gumbel noise): chi-square
over 20k draws, each with its own seed, p-value printed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.decoding.sampler import Sampler, draw, filtered_probs
from pdserve.engine.speculation.verification import verify
from tests.engine.speculation.test_verification import (
    DRAWS,
    FILTERS,
    VOCAB,
    assert_distributed_as,
    target_logits,
)


@pytest.mark.parametrize("draft_kind", ["point_mass", "drawn_from_q", "coupled"])
@pytest.mark.parametrize("name", sorted(FILTERS))
def test_the_coupled_draw_keeps_the_target_distribution(name, draft_kind):
    params = [dataclasses.replace(FILTERS[name], seed=s) for s in range(DRAWS)]
    logits = target_logits(3)  # 2 drafts: rows judge draft 1, draft 2, then the next token
    p = filtered_probs(logits, params[:1] * 3)
    sampler = Sampler()
    generators = [[sampler.generator_for(x, n) for n in range(3)] for x in params]
    gen = torch.Generator().manual_seed(1)
    q_logits = logits[:2] + 0.5 * torch.randn(2, VOCAB, generator=gen)  # a draft near the target
    if draft_kind == "point_mass":  # the second most likely token, then the most likely
        guess = [int(p[0].argsort(descending=True)[1]), int(p[1].argmax())]
        drafts = torch.tensor([guess] * DRAWS)
    elif draft_kind == "drawn_from_q":  # independent of the target's noise
        q = torch.softmax(q_logits, dim=-1)
        drafts = torch.stack(
            [torch.multinomial(q[i], DRAWS, True, generator=gen) for i in (0, 1)]
        ).T
    else:  # as the draft proposer draws: q's race with the target's noise of the position
        own = [[sampler.generator_for(x, n) for x in params] for n in (0, 1)]
        drafts = torch.stack(
            [draw(q_logits[i].expand(DRAWS, VOCAB), params, own[i]) for i in (0, 1)]
        ).T
    out = verify(logits.expand(DRAWS, 3, VOCAB), drafts, None, params, generators)
    first = torch.bincount(torch.tensor([v.token_ids[0] for v in out]), minlength=VOCAB)
    after = [v.token_ids[1] for v in out if v.num_accepted >= 1]
    second = torch.bincount(torch.tensor(after, dtype=torch.int64), minlength=VOCAB)
    label = f"{name}/{draft_kind}"
    assert_distributed_as(first, p[0], f"{label} token 1")
    assert_distributed_as(second, p[1], f"{label} token 2 after an accepted draft")
    # Token 1 is the plain draw of position 0 whatever was drafted.
    fresh = [sampler.generator_for(x, 0) for x in params]
    plain = draw(logits[:1].expand(DRAWS, VOCAB), params, fresh)
    assert [v.token_ids[0] for v in out] == plain.tolist()
    accepted = sum(v.num_accepted for v in out) / (2 * DRAWS)
    print(f"{label}: acceptance rate {accepted:.3f}")
