"""The two workloads of `pdserve bench spec`, built for the model measured (no torch import at
module level).

- `repeating`: prompts whose greedy continuation repeats text already in the context, so
  proposals can be right. A random-weight model copies nothing by itself, but fed one token
  over and over its greedy output often settles into a short cycle. Candidates `[t] * n` are
  run ahead greedily for `warmup` tokens; each prompt is a candidate plus its run-ahead (the
  model is then inside its cycle), the candidates whose run-ahead prompt lookup predicts best
  first.
- `novel`: uniformly random prompts: the continuation rarely repeats the context (a large
  vocabulary), so next to nothing is accepted.
"""

from __future__ import annotations

from typing import Any

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.speculation.ngram_proposer import lookup


def novel_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def repeating_prompts(
    engine: Any, count: int, length: int, warmup: int, candidates: int = 0
) -> tuple[list[list[int]], float]:
    """`count` prompts (a token repeated `length` times + the model's greedy run-ahead of
    `warmup` tokens) and the mean lookup hit rate of the chosen run-aheads' second halves."""
    vocab = engine.executor.vocab_size
    pool = max(candidates, 2 * count)
    stride = max(1, (vocab - 3) // pool)
    starts = [[3 + i * stride] * length for i in range(pool)]
    params = SamplingParams(max_tokens=warmup, temperature=0.0, ignore_eos=True)
    runs = engine.generate(starts, params)
    scored = sorted(
        (
            (_hit_rate(s + r, len(s) + warmup // 2), s + r)
            for s, r in zip(starts, runs, strict=True)
        ),
        key=lambda pair: -pair[0],
    )[:count]
    return [prompt for _, prompt in scored], sum(rate for rate, _ in scored) / count


def _hit_rate(tokens: list[int], start: int) -> float:
    """How often prompt lookup's first guess is the next token, from `start` on."""
    hits = sum(lookup(tokens[:i], 1, 3, 1) == [tokens[i]] for i in range(start, len(tokens)))
    return hits / max(1, len(tokens) - start)
