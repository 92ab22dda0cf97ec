"""Verification of speculative drafts: which of a proposer's tokens the target accepts, and
the target's own token after them.

A sequence with d drafts x_1..x_d was computed in one forward over its last real token and the
drafts, giving d + 1 rows of logits: row i (0-based) is the target's distribution of the token
after x_i (row 0: after the last real token), so row i judges x_{i+1} and row d gives the
token after the last draft.

- Greedy requests accept drafts while they equal the row's argmax (ties: the lowest id, as the
  Sampler), then take the argmax of the first row that disagrees, or of row d after all d
  were accepted. The output is the target's greedy output token for token.
- Seeded sampled requests use the coupled draw (the seed contract, sampler.py): the token at
  output index n is always the one the plain sampler draws there, `sampler.draw` of the row
  with the Gumbel noise of (seed, seed_offset + n); draft x is accepted iff it is that token,
  and the first disagreeing row (or row d) gives its own draw. So a seeded request's tokens
  are the same whether a step verifies or not, with how many drafts, or after a retry:
  speculation changes the speed only. Each emitted token is the plain draw, so it follows the
  target's filtered distribution p exactly. The draft proposer races its own filtered logits
  with the same noises (draft_model_proposer.py), so a draft is accepted where both races have the
  same winner: always when p == q, and close to rejection sampling's sum_x min(p(x), q(x))
  when q is near p (a draft drawn independently of the noise would be accepted with
  sum_x q(x) p(x) only). For a point mass (prompt lookup) both rules accept with p(x).
- Unseeded sampled requests promise no stream and use rejection sampling (Leviathan et al.
  2023, Chen et al. 2023): with q the draft's distribution (a point mass on x when the proposer
  gives none), x is accepted with probability min(1, p(x) / q(x)); at the first rejection the
  token is drawn from norm(max(0, p - q)) and verification stops; after d acceptances one more
  token is drawn from row d. The acceptance uniforms, then the draw's, come from the
  sampler's shared generator; a draw is one uniform through the cumulative distribution
  (`sampler.inverse_cdf`).
- Logprobs are as the Sampler's: log-softmax of the row's logits (before temperature).
"""

from __future__ import annotations

import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding.sampler import DrawSource, draw, filtered_probs, inverse_cdf, uniforms
from pdserve.engine.scheduler import Verified


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    params: list[SamplingParams],
    generators: list[list[DrawSource]],
) -> list[Verified]:
    """Verifies B sequences with d drafts each. logits: [B, d + 1, vocab] float32 (row i of a
    sequence judges its draft i + 1; row d gives the token after them); drafts: [B, d] token
    ids; q: the drafts' [B, d, vocab] distributions, or None (point masses; only unseeded
    sampled rows read q); params: each sequence's; generators[b][i] (i = 0..d): what sequence
    b's token at its i-th position from its first draft's on is drawn with
    (`Sampler.generator_for`: a seeded request's noise key, else a generator)."""
    batch, rows, vocab = logits.shape
    d = rows - 1
    next_tokens = logits.argmax(dim=-1)  # greedy: the target's choice at every row
    agree = (next_tokens[:, :d] == drafts).long()
    accepted = agree.cumprod(dim=1).sum(dim=1)  # drafts before the first disagreement
    seeded = [b for b, p in enumerate(params) if not p.greedy and p.seed is not None]
    if seeded:
        index = torch.tensor(seeded)
        picked = _coupled_draw(
            logits[index],
            drafts[index],
            [params[b] for b in seeded],
            [generators[b] for b in seeded],
        )
        accepted[index], next_tokens[index, 0] = picked
    unseeded = [b for b, p in enumerate(params) if not p.greedy and p.seed is None]
    if unseeded:
        index = torch.tensor(unseeded)
        picked = _rejection_sample(
            logits[index],
            drafts[index],
            None if q is None else q[index],
            [params[b] for b in unseeded],
            [generators[b] for b in unseeded],
        )
        accepted[index], next_tokens[index, 0] = picked
    final = torch.where(
        torch.tensor([p.greedy for p in params]),
        next_tokens.gather(1, accepted[:, None]).squeeze(1),
        next_tokens[:, 0],
    )
    out = []
    draft_lists, counts, finals = drafts.tolist(), accepted.tolist(), final.tolist()
    for b in range(batch):
        tokens = draft_lists[b][: counts[b]] + [finals[b]]
        out.append(Verified(tokens, None, counts[b]))
    want = [b for b, p in enumerate(params) if p.logprobs]
    if want:
        logprobs = torch.log_softmax(logits[torch.tensor(want)].float(), dim=-1)
        for row, b in zip(logprobs, want, strict=True):
            tokens = torch.tensor(out[b].token_ids)
            out[b].logprobs = row[: len(tokens)].gather(1, tokens[:, None]).squeeze(1).tolist()
    return out


def _coupled_draw(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    params: list[SamplingParams],
    keys: list[list[DrawSource]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded sequences: every row's plain draw with its position's noise key; drafts are
    accepted while they equal it, and the draw of the row after them is emitted."""
    batch, rows, vocab = logits.shape
    plain = draw(
        logits.reshape(batch * rows, vocab),
        [x for x in params for _ in range(rows)],
        [key for row_keys in keys for key in row_keys],
    )
    plain = plain.view(batch, rows)
    accepted = (plain[:, :-1] == drafts).long().cumprod(dim=1).sum(dim=1)
    return accepted, plain.gather(1, accepted[:, None]).squeeze(1)


def _rejection_sample(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    params: list[SamplingParams],
    generators: list[list[torch.Generator]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unseeded sampled sequences: how many drafts each accepts, and the token each emits
    after them."""
    batch, rows, vocab = logits.shape
    d = rows - 1
    p = filtered_probs(
        logits.reshape(batch * rows, vocab), [x for x in params for _ in range(rows)]
    )
    p = p.view(batch, rows, vocab)
    uniform = torch.empty(batch, d)
    for b, gens in enumerate(generators):
        for i in range(d):
            uniform[b, i] = torch.rand((), generator=gens[i])
    p_x = p[:, :d].gather(2, drafts[..., None]).squeeze(2)
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, drafts[..., None]).squeeze(2)
    accepted = (uniform * q_x < p_x).long().cumprod(dim=1).sum(dim=1)  # P = min(1, p/q)
    # The first rejected row draws from norm(max(0, p - q)); after d acceptances, row d from p.
    at = accepted.clamp(max=max(d - 1, 0))[:, None, None].expand(batch, 1, vocab)
    weights = p[:, -1]
    if d:
        p_row = p[:, :d].gather(1, at).squeeze(1)
        if q is None:
            x = drafts.gather(1, at[:, :, 0]).squeeze(1)
            residual = p_row.scatter(1, x[:, None], 0.0)
        else:
            residual = (p_row - q.gather(1, at).squeeze(1)).clamp(min=0.0)
        # p <= q everywhere only where p == q, whose draft is always accepted.
        residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_row)
        weights = torch.where((accepted < d)[:, None], residual, weights)
    drawing = [gens[n] for gens, n in zip(generators, accepted.tolist(), strict=True)]
    return accepted, inverse_cdf(weights, uniforms(drawing))
