"""Sampler: one next token per sequence from its logits, under that sequence's params.

Greedy rows (temperature below `GREEDY_TEMPERATURE`, 0 included, since dividing by a tinier one
overflows) take the argmax (ties: the lowest id, like transformers). Sampled rows apply
temperature, then top-k, then top-p, and draw by inverting the cumulative distribution of the
tokens they keep, taken in vocabulary order, with one uniform number: a categorical draw.

The seed contract: a seeded request's n-th token is the token where the uniform of (seed,
seed_offset + n) falls in the cumulative distribution of its own kept tokens in vocabulary
order. That layout depends on the row alone (not on which filters other rows of the batch ask
for, which decide only how the kept tokens are found), so the token is a function of the seed,
n and the request's own distribution: the same whatever shares the batch, on any worker, and
after a retry that continues at n (`seed_offset`). Speculative verification draws every
position with this same function and uniform (speculation/verification.py), so speculation
never changes a seeded request's tokens.

Only the kept tokens are put in order: top-k takes the k best (`topk`), and top-p looks for
its nucleus among the `NUCLEUS_CANDIDATES` best before sorting a whole row; a row without
either is not sorted. The kept tokens found among the best are then put back in vocabulary
order (a sort of those few ids), a whole sorted row by a scatter. At a 128k vocabulary and 32
sampled rows, sorting every row took 0.41 s and an exponential noise per token 0.12 s (of a
0.61 s sampling step on a 2-core VM), 0.02-0.03 s now unless a nucleus covers most of the
vocabulary (BENCHMARKS.md, "Sampling"). These rows are drawn on the host, where the generators
are.

Before choosing, a request with `repetition_penalty` != 1 has the logit of every token it has
seen (prompt and output) divided by the penalty where positive and multiplied by it where
negative (transformers' RepetitionPenaltyLogitsProcessor). Logprobs are of the distribution the
token is chosen from, after that penalty (and DoLa/SLED), before temperature.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from pdserve.core.sampling_params import SamplingParams


def token_seed(seed: int, n: int) -> int:
    """Deterministic seed of a request's n-th token (the same in every process)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed & (2**64 - 1), n), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seeded_generator(params: SamplingParams, n: int) -> torch.Generator:
    """The generator of a seeded request's n-th token: seeded by (seed, seed_offset + n)."""
    assert params.seed is not None
    return torch.Generator().manual_seed(token_seed(params.seed, params.seed_offset + n))


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
    ) -> tuple[list[int], list[float | None]]:
        # Penalty and argmax where the logits are: on a GPU only the token ids, and the rows
        # that the host's generators sample, cross to the host (a batch's whole logits are
        # ~0.5 MB per row at a 128k vocabulary).
        logits = apply_repetition_penalty(logits.float(), params, token_ids)
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

    def generator_for(self, params: SamplingParams, n: int) -> torch.Generator:
        """The generator of a request's n-th token: its own for a seeded request, else the
        sampler's shared one."""
        if params.seed is None:
            return self._generator
        return seeded_generator(params, n)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]
    ) -> torch.Tensor:  # [M, vocab] -> [M] token ids
        generators = [self.generator_for(p, n) for p, n in zip(params, token_indices, strict=True)]
        return draw(logits, params, uniforms(generators))


def uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """[M] float64: the uniform a token is drawn with, one from each row's generator."""
    return torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])


def draw(logits: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    """[M, vocab] sampled rows' logits -> [M] token ids: each row's `uniform` through the
    cumulative distribution of its kept tokens in vocabulary order (the seed contract)."""
    probs, ids = kept_tokens(logits, params)
    return ids.gather(1, inverse_cdf(probs, uniform)[:, None]).squeeze(1)


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
    ids, K covering every token a sampled row may draw: the rows' top k, the nucleus within the
    NUCLEUS_CANDIDATES best, or (when a nucleus reaches past them, or no row filters) the
    vocabulary. The kept tokens and their probabilities are the same whichever of these holds
    them (those of the whole row sorted), and each row's kept tokens come in vocabulary order:
    the layout a row's uniform is mapped through depends on that row alone."""
    scaled = _with_temperature(logits, params)
    rows, vocab = scaled.shape
    everything = torch.logsumexp(scaled, dim=-1)
    if all(p.top_k <= 0 and p.top_p >= 1.0 for p in params):
        probs = torch.exp(scaled - everything[:, None])
        return probs, torch.arange(vocab).expand(rows, vocab)
    k = max([p.top_k for p in params if p.top_k > 0] + [NUCLEUS_CANDIDATES])
    if k < vocab and all(p.top_k > 0 or p.top_p < 1.0 for p in params):
        values, order = scaled.topk(k, dim=-1)  # in descending order
        # A row without top-k keeps token k + 1 too unless its first k reach top_p; summed
        # as `_filtered_sorted` sums them, so both agree on where the nucleus ends.
        mass = torch.cumsum(torch.exp(values - everything[:, None]), dim=-1)[:, -1]
        unbounded = torch.tensor([p.top_k <= 0 for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        if not bool((unbounded & (mass < top_p)).any()):
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
    """Top-k, then top-p over a row's best tokens in order: their probabilities, 0 for the
    dropped ones. A row with top-k is normalised over its k best, any other over the whole
    vocabulary; the first K positions come out the same whatever K."""
    rank = torch.arange(values.shape[-1])[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    values = values.masked_fill(rank >= top_k[:, None], float("-inf"))
    denominator = torch.where(top_k < vocab, torch.logsumexp(values, dim=-1), everything)
    probs = torch.exp(values - denominator[:, None])
    # top_p == 1 must keep the whole tail even where the cumulative sum rounds to 1.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params])
    # Drop a token when the tokens ranked above it already reach top_p (the first stays).
    before = torch.cumsum(probs, dim=-1) - probs
    return probs.masked_fill(before >= top_p[:, None], 0.0)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row draws its token from ([N, vocab], vocab order, rows
    summing to 1): the sampler's temperature / top-k / top-p filtering of `logits`."""
    probs, ids = kept_tokens(logits.float(), params)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros(logits.shape, dtype=probs.dtype).scatter_(1, ids, probs)


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
