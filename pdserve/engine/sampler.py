"""Sampler: one next token per sequence from its logits, under that sequence's params.

Greedy rows (temperature below `GREEDY_TEMPERATURE`, 0 included, since dividing by a tinier one
overflows) take the argmax (ties: the lowest id, like transformers). Sampled rows apply
temperature, then top-k, then top-p, and draw by the exponential race (argmax p / E with
E ~ Exp(1)), which equals a categorical draw. A seeded request's n-th token uses noise from
a generator seeded by (seed, n) alone, so its output does not depend on what else is in the
batch, and a decode worker continues a prefill worker's stream exactly.

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


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()  # noise of unseeded requests
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
        return torch.Generator().manual_seed(token_seed(params.seed, params.seed_offset + n))

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]
    ) -> torch.Tensor:  # [M, vocab] -> [M] token ids
        probs, order = sorted_filtered_probs(logits, params)
        noise = torch.empty_like(probs)
        for i, (p, n) in enumerate(zip(params, token_indices, strict=True)):
            noise[i].exponential_(generator=self.generator_for(p, n))
        choice = (probs / noise).argmax(dim=-1)
        return order.gather(1, choice[:, None]).squeeze(1)


def sorted_filtered_probs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sampled row draws from: temperature, then top-k, then top-p. Returns the
    probabilities sorted in descending order of logit (filtered ones 0, the rest not
    renormalised after top-p: a draw by probs / noise does not need it) and that order."""
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    logits = logits / temps[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top_p == 1 must keep the whole tail even where the cumulative sum rounds to 1.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params])
    # Drop a token when the tokens ranked above it already reach top_p (the first stays).
    before = torch.cumsum(probs, dim=-1) - probs
    return probs.masked_fill(before >= top_p[:, None], 0.0), order


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row draws its token from ([N, vocab], vocab order, rows
    summing to 1): the sampler's temperature / top-k / top-p filtering of `logits`."""
    probs, order = sorted_filtered_probs(logits.float(), params)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


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
