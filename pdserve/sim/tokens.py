"""The tokens a simulated model produces: a deterministic function of the context.

The next token hashes the last `CONTEXT_TOKENS` token ids and the position it takes, so a
retry whose prompt carries the tokens already sent, or a decode worker continuing a prefill
worker's request, produces exactly the same continuation. A seeded sampled request also mixes
in (seed, its token index), as the real sampler does; an unseeded sampled one mixes in fresh
randomness. The hash is Python's `hash()` of a tuple of ints: unlike that of str or bytes it
is not salted per process (PYTHONHASHSEED), and its algorithm (ints modulo 2**61 - 1, tuples
by xxHash rounds) is the same on every 64-bit CPython since 3.8, so every worker process and
the planner agree (tests/sim/test_token_processes.py). Special tokens (BOS, EOS) are never
produced: a request ends by max_tokens, a stop string or stop_token_ids.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

CONTEXT_TOKENS = 4


class TokenSpace:
    """The ids a simulated model may produce: [0, vocab_size) minus `avoid`."""

    def __init__(self, vocab_size: int, avoid: set[int]) -> None:
        self.avoid = sorted(t for t in avoid if 0 <= t < vocab_size)
        self.size = vocab_size - len(self.avoid)
        if self.size <= 0:
            raise ValueError("the vocabulary has no token besides special ones")
        # Indices below the first avoided id are ids as they are; those at or past the last
        # are shifted by all of them (special ids usually sit at one end of the vocabulary).
        self._first_avoided = self.avoid[0] if self.avoid else 0
        self._last_avoided = self.avoid[-1] if self.avoid else -1

    def nth(self, index: int) -> int:
        """The index-th allowed id: skips the avoided ids at or below it."""
        if index < self._first_avoided:  # no avoided id lies at or below it
            return index
        if index >= self._last_avoided:  # every avoided id lies below: all of them shift it
            return index + len(self.avoid)
        token = index
        # Each avoided id at or below the candidate shifts it up by one.
        while True:
            shifted = index + bisect.bisect_right(self.avoid, token)
            if shifted == token:
                return token
            token = shifted


def sim_token(
    context: Sequence[int], space: TokenSpace, salt: tuple[int, int] | None = None
) -> tuple[int, float]:
    """(next token, its log-probability) after `context`; `salt` = (seed, token index) of a
    sampled request, None for greedy. The log-probability is a deterministic value in (-10, 0]."""
    # Runs once per simulated token (the planner makes millions): with a tuple's hash the call
    # takes ~0.43 us, where packing the fields and hashing them with blake2b took ~1.0 us.
    fields = (len(context), *context[-CONTEXT_TOKENS:])
    value = hash(fields if salt is None else (*fields, *salt)) & _U64
    token = space.nth(value % space.size)
    # From the hash's top 24 bits (the token is its residue modulo the vocabulary).
    logprob = -((value >> 40) % 10_000) / 1_000
    return token, logprob


_U64 = 2**64 - 1  # hash() is a signed 64-bit value; its bits as an unsigned one
