"""The tokens a simulated model produces: a deterministic function of the context.

The next token hashes the last `CONTEXT_TOKENS` token ids and the position it takes, so a
retry whose prompt carries the tokens already sent, or a decode worker continuing a prefill
worker's request, produces exactly the same continuation. A seeded sampled request also mixes
in (seed, its token index), as the real sampler does; an unseeded sampled one mixes in fresh
randomness. Special tokens (BOS, EOS) are never produced: a request ends by max_tokens, a
stop string or stop_token_ids.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence

CONTEXT_TOKENS = 4


class TokenSpace:
    """The ids a simulated model may produce: [0, vocab_size) minus `avoid`."""

    def __init__(self, vocab_size: int, avoid: set[int]) -> None:
        self.avoid = sorted(t for t in avoid if 0 <= t < vocab_size)
        self.size = vocab_size - len(self.avoid)
        if self.size <= 0:
            raise ValueError("the vocabulary has no token besides special ones")

    def nth(self, index: int) -> int:
        """The index-th allowed id: skips the avoided ids at or below it."""
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
    tail = list(context[-CONTEXT_TOKENS:])
    fields = [len(context), *tail, *(salt or ())]
    packed = struct.pack(f"<{len(fields)}Q", *(f & (2**64 - 1) for f in fields))
    digest = hashlib.blake2b(packed, digest_size=16, person=b"pdserve-sim").digest()
    value = int.from_bytes(digest, "little")
    token = space.nth(value % space.size)
    logprob = -((value >> 64) % 10_000) / 1_000
    return token, logprob
