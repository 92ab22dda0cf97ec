"""NgramProposer: speculative decoding's prompt-lookup proposer (the contract is in proposer.py).

`NgramProposer` is prompt lookup (transformers' `prompt_lookup_num_tokens`, vLLM's ngram): the
longest suffix of prompt + output, from `ngram_max` down to `ngram_min` tokens, that occurred
earlier; its earliest occurrence's next k tokens are the guess. The search is a byte-string
find over the token ids (O(len) per n-gram length, in C).
"""

from __future__ import annotations

from array import array
from typing import Any

from pdserve.engine.sequence import Sequence


class NgramProposer:
    """Prompt lookup: continues the longest suffix n-gram seen earlier in the sequence."""

    writes_kv = False

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self._num_proposed = 0

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        self._num_proposed = len(seqs)
        return [lookup(seq.token_ids, k, self.ngram_max, self.ngram_min) for seq in seqs]

    def draft_probs(self) -> list[Any | None]:
        return [None] * self._num_proposed

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass


def lookup(tokens: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The k tokens that followed the earliest earlier occurrence of the longest suffix of
    `tokens` (ngram_max down to ngram_min tokens long); [] when no suffix occurred before."""
    length = len(tokens)
    if length < 2:
        return []
    data = array("I", tokens).tobytes()  # 4 bytes per token id: a match must start aligned
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = data[4 * (length - n) :]
        end = 4 * (length - 1)  # an occurrence must end before the suffix's last token
        at = data.find(suffix, 0, end)
        while at != -1 and at % 4:
            at = data.find(suffix, at + 1, end)
        if at != -1:
            start = at // 4 + n
            return tokens[start : start + k]
    return []
