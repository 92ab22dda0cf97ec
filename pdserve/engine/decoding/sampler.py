"""Sampler: one next token per sequence from its logits, under that sequence's params.

Greedy rows (temperature below `GREEDY_TEMPERATURE`, 0 included, since dividing by a tinier one
overflows) take the argmax (ties: the lowest id, like transformers). Sampled rows apply
temperature, then top-k, then top-p, then min-p (transformers' order), and draw from the
tokens they keep.

The seed contract: a seeded request's n-th token is the Gumbel-max draw of its own filtered
distribution with the noise of (seed, seed_offset + n): the argmax over its kept tokens of
logits / temperature + G(key, token id), G a Gumbel noise hashed from the position's key and
the token id (seeded_noise.py), which is exactly a draw of the filtered distribution. Each
token's score depends on that token alone, so the token is a function of the seed, n and the
request's own distribution: the same whatever shares the batch, however the kept tokens are
laid out, on any worker, and after a retry that continues at n (`seed_offset`). Speculative
verification draws every position with this same function (speculation/verification.py), and a draft
model races its own logits with the same noises (speculation/draft_model_proposer.py), so speculation never
changes a seeded request's tokens and accepts a draft wherever the draft's race has the
target's winner. The price is a hashed noise per kept token: the whole vocabulary for a row
without top-k or a small nucleus (docs/decoding.md, "Seeded sampling").

Unseeded rows (no stream to keep) draw by inverting the cumulative distribution of their kept
tokens with one uniform from the sampler's shared generator: a categorical draw.

Only the kept tokens are put in order: top-k takes the k best (`topk`), and top-p or min-p look
for their last kept token among the `NUCLEUS_CANDIDATES` best before sorting a whole row; a row
without a filter is not sorted. The kept tokens found among the best are then put back in
vocabulary order (a sort of those few ids), a whole sorted row by a scatter. At a 128k
vocabulary and 32 sampled rows, sorting every row took 0.41 s and an exponential noise per
token 0.12 s (of a 0.61 s sampling step on a 2-core VM), 0.02-0.03 s now unless a nucleus
covers most of the vocabulary (BENCHMARKS.md, "Sampling"). These rows are drawn on the host,
where the generators are.

Before choosing, a request with `repetition_penalty` != 1 has the logit of every token it has
seen (prompt and output) divided by the penalty where positive and multiplied by it where
negative (transformers' RepetitionPenaltyLogitsProcessor), and a request with fewer than
`min_tokens` output tokens has its stop tokens (`Sequence.min_tokens_mask`: stop_token_ids and
EOS) at -inf, so they are never chosen (vLLM's min_tokens; transformers'
MinNewTokensLengthLogitsProcessor). Logprobs are of the distribution the token is chosen from,
after the penalty, the mask (and DoLa/SLED), before temperature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding.seeded_draw import gumbel_max
from pdserve.engine.decoding.seeded_noise import token_key

# What a row's token is drawn with: a seeded request's noise key at that position (an int,
# `noise_key`), or an unseeded one's generator.
DrawSource = int | torch.Generator


def noise_key(params: SamplingParams, n: int) -> int:
    """The noise key of a seeded request's n-th token: that of (seed, seed_offset + n)."""
    assert params.seed is not None
    return token_key(params.seed, params.seed_offset + n)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()  # the draws of unseeded requests
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,  # [N, vocab] float32
        params: list[SamplingParams],
        token_indices: list[int],  # n of each row: how many tokens its request already has
        token_ids: Sequence[Sequence[int]] = (),  # each row's prompt + output (repetition penalty)
        stop_ids: Sequence[Sequence[int]] = (),  # each row's Sequence.min_tokens_mask
    ) -> tuple[list[int], list[float | None]]:
        # Penalty and argmax where the logits are: on a GPU only the token ids, and the rows
        # that the host's generators sample, cross to the host (a batch's whole logits are
        # ~0.5 MB per row at a 128k vocabulary).
        logits = apply_repetition_penalty(logits.float(), params, token_ids)
        logits = mask_stops_before_min_tokens(logits, params, token_indices, stop_ids)
        device = logits.device
        tokens = logits.argmax(dim=-1).cpu()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = torch.tensor(sampled)
            picked = self._sample(
                logits[rows.to(device)].cpu(),
                [params[i] for i in sampled],
                [token_indices[i] for i in sampled],
            )
            tokens[rows] = picked
        want = [i for i, p in enumerate(params) if p.logprobs]
        logprobs: list[float | None] = [None] * len(params)
        if want:
            rows = torch.tensor(want)
            # Log-probabilities under the model's own distribution (before temperature).
            chosen = tokens[rows, None].to(device)
            lp = torch.log_softmax(logits[rows.to(device)], dim=-1).gather(1, chosen)
            for i, value in zip(want, lp.squeeze(1).tolist(), strict=True):
                logprobs[i] = value
        return tokens.tolist(), logprobs

    def generator_for(self, params: SamplingParams, n: int) -> DrawSource:
        """What a request's n-th token is drawn with: a seeded request's noise key, else the
        sampler's shared generator."""
        if params.seed is None:
            return self._generator
        return noise_key(params, n)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]
    ) -> torch.Tensor:  # [M, vocab] -> [M] token ids
        sources = [self.generator_for(p, n) for p, n in zip(params, token_indices, strict=True)]
        return draw(logits, params, sources)


def uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """[M] float64: the uniform a token is drawn with, one from each row's generator."""
    return torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])


def draw(
    logits: torch.Tensor, params: list[SamplingParams], sources: list[DrawSource]
) -> torch.Tensor:
    """[M, vocab] sampled rows' logits -> [M] token ids from their filtered distributions: a
    seeded row's Gumbel-max draw with its key's noise (the seed contract), an unseeded row's
    uniform from its generator through the cumulative distribution of its kept tokens."""
    probs, ids = kept_tokens(logits, params)
    tokens = torch.empty(len(params), dtype=torch.int64)
    seeded = [i for i, s in enumerate(sources) if isinstance(s, int)]
    if seeded:
        rows = torch.tensor(seeded)
        keys = torch.tensor([sources[i] for i in seeded], dtype=torch.int64)
        scaled = _with_temperature(logits[rows], [params[i] for i in seeded])
        tokens[rows] = gumbel_max(scaled, probs[rows], ids[rows], keys)
    unseeded = [i for i, s in enumerate(sources) if not isinstance(s, int)]
    if unseeded:
        rows = torch.tensor(unseeded)
        uniform = uniforms([sources[i] for i in unseeded])
        tokens[rows] = ids[rows].gather(1, inverse_cdf(probs[rows], uniform)[:, None]).squeeze(1)
    return tokens


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A categorical draw per row of `weights` ([M, K], >= 0, not all 0): the column where the
    row's uniform ([M] float64) falls in the row's cumulative sum."""
    # In float64 a uniform below 1 stays below the total, so the draw lands on a positive weight.
    cdf = weights.double().cumsum(dim=-1)
    target = (uniform * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)[:, 0]


# Tokens a top-p row puts in order first: its nucleus is searched among them, and only when it
# reaches past them is the whole row sorted.
NUCLEUS_CANDIDATES = 1024


def kept_tokens(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] probabilities (not renormalised; 0 for tokens the filters drop) and their token
    ids, K covering every token a sampled row may draw: the rows' top k, the nucleus or min-p
    cut within the NUCLEUS_CANDIDATES best, or (when one reaches past them, or no row filters)
    the vocabulary, then in id order (K == vocab means ids are the vocabulary in order). The
    kept tokens and their probabilities are the same whichever of these holds them (those of
    the whole row sorted), and each row's kept tokens come in vocabulary order."""
    scaled = _with_temperature(logits, params)
    rows, vocab = scaled.shape
    everything = torch.logsumexp(scaled, dim=-1)
    if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        probs = torch.exp(scaled - everything[:, None])
        return probs, torch.arange(vocab).expand(rows, vocab)
    k = max([p.top_k for p in params if p.top_k > 0] + [NUCLEUS_CANDIDATES])
    if k < vocab and all(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        values, order = scaled.topk(k, dim=-1)  # in descending order
        # A row without top-k keeps token k + 1 too unless its first k reach top_p (summed
        # as `_filtered_sorted` sums them, so both agree on where the nucleus ends) or min-p
        # drops the last of them (so every later one too).
        mass = torch.cumsum(torch.exp(values - everything[:, None]), dim=-1)[:, -1]
        unbounded = torch.tensor([p.top_k <= 0 for p in params])
        nucleus_inside = mass >= _top_p(params)
        min_p_inside = values[:, -1] < _min_p_floor(values, params)
        if not bool((unbounded & ~nucleus_inside & ~min_p_inside).any()):
            return _in_vocabulary_order(_filtered_sorted(values, everything, params, vocab), order)
    values, order = scaled.sort(dim=-1, descending=True)
    probs = _filtered_sorted(values, everything, params, vocab)
    # The whole row: scattered back to vocabulary order (cheaper than sorting ids again).
    return torch.zeros_like(probs).scatter_(1, order, probs), torch.arange(vocab).expand(
        rows, vocab
    )


def _in_vocabulary_order(
    probs: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates in descending order -> the kept ones in ascending id order, the dropped ones
    (probability 0, never drawn) after them."""
    key = torch.where(probs > 0, ids, torch.iinfo(ids.dtype).max)
    order = key.argsort(dim=-1)
    return probs.gather(1, order), ids.gather(1, order)


def _with_temperature(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    return logits / temps[:, None]


def _filtered_sorted(
    values: torch.Tensor,  # [M, K] the K best scaled logits of each row, in descending order
    everything: torch.Tensor,  # [M] logsumexp of each whole row
    params: list[SamplingParams],
    vocab: int,
) -> torch.Tensor:
    """Top-k, then top-p, then min-p over a row's best tokens in order: their probabilities, 0
    for the dropped ones. A row with top-k is normalised over its k best, any other over the
    whole vocabulary; the first K positions come out the same whatever K."""
    rank = torch.arange(values.shape[-1])[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    values = values.masked_fill(rank >= top_k[:, None], float("-inf"))
    denominator = torch.where(top_k < vocab, torch.logsumexp(values, dim=-1), everything)
    probs = torch.exp(values - denominator[:, None])
    # Drop a token when the tokens ranked above it already reach top_p (the first stays).
    before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(before >= _top_p(params)[:, None], 0.0)
    return probs.masked_fill(values < _min_p_floor(values, params)[:, None], 0.0)


def _top_p(params: list[SamplingParams]) -> torch.Tensor:
    """[M] each row's top_p; 2 where off: top_p == 1 keeps the whole tail even where a
    cumulative sum rounds to 1."""
    return torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params])


def _min_p_floor(values: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[M] the scaled logit below which min-p drops a token: the best one's + log(min_p), -inf
    when off. A probability ratio compared as logits, exact whatever the row's normaliser."""
    min_p = torch.tensor([p.min_p for p in params], dtype=values.dtype)
    return values[:, 0] + torch.log(min_p)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row draws its token from ([N, vocab], vocab order, rows
    summing to 1): the sampler's temperature / top-k / top-p filtering of `logits`."""
    probs, ids = kept_tokens(logits.float(), params)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros(logits.shape, dtype=probs.dtype).scatter_(1, ids, probs)


def mask_stops_before_min_tokens(
    logits: torch.Tensor,  # [N, vocab] float32
    params: Sequence[SamplingParams],
    token_indices: Sequence[int],  # n of each row: the output tokens before the one chosen
    stop_ids: Sequence[Sequence[int]],  # each row's stop tokens (empty: none to mask)
) -> torch.Tensor:
    """`logits`, or a copy with each row's stop tokens at -inf while its output is shorter than
    its min_tokens (vLLM's min_tokens)."""
    masked = [
        (row, token)
        for row, (p, n, ids) in enumerate(zip(params, token_indices, stop_ids, strict=False))
        if n < p.min_tokens
        for token in ids
    ]
    if not masked:
        return logits
    rows, tokens = torch.tensor(masked, device=logits.device).T
    logits = logits.clone()
    logits[rows, tokens] = float("-inf")
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor,  # [N, vocab] float32
    params: list[SamplingParams],
    token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """`logits`, or a copy penalised on the rows whose request sets repetition_penalty."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    longest = max(len(token_ids[i]) for i in rows)
    # Rows padded by repeating their first token: a repeated index rewrites the same value.
    device = logits.device
    seen = torch.tensor(
        [list(token_ids[i]) + [token_ids[i][0]] * (longest - len(token_ids[i])) for i in rows],
        device=device,
    )
    penalty = torch.tensor([params[i].repetition_penalty for i in rows], device=device)[:, None]
    index = torch.tensor(rows, device=device)
    picked = logits[index].gather(1, seen)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    logits = logits.clone()
    logits[index] = logits[index].scatter(1, seen, picked)
    return logits
