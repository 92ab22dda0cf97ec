"""PromptTokens: a prompt's token ids that remember their chained block hashes.

A prompt offered again and again is hashed once per block size instead of at every routing
decision and in every engine that computes or receives it, as vLLM's Request keeps its block
hashes. The offline planner offers the same sample of prompts in every rate probe of every
split: each prompt was hashed by the router, the scheduler, the prefill worker's cache and the
decode worker's commit, in every probe (4-8% of a probe's CPU).

It is a list (callers that build on a prompt, `prompt + emitted`, get a plain list back) whose
contents cannot change, so the remembered hashes cannot go stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from pdserve.core.block_hash import prompt_block_hashes


class PromptTokens(list):
    __slots__ = ("_hashes",)

    def __init__(self, token_ids: Sequence[int] = ()) -> None:
        super().__init__(token_ids)
        self._hashes: dict[int, tuple[int, ...]] = {}

    def block_hashes(self, block_size: int) -> tuple[int, ...]:
        """`prompt_block_hashes` of these tokens, computed on the first call per block size."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = tuple(prompt_block_hashes(self, block_size))
        return hashes

    def _immutable(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("PromptTokens cannot change (its block hashes are remembered)")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _immutable
    append = extend = insert = pop = remove = clear = sort = reverse = _immutable

    def __reduce__(self):  # a copy or pickle is a PromptTokens again (its hashes recomputed)
        return (PromptTokens, (list(self),))


def block_hashes_of(token_ids: Sequence[int], block_size: int) -> Sequence[int]:
    """Chained hashes of the full blocks of `token_ids` (`prompt_block_hashes`): remembered
    ones when they are PromptTokens. Read-only: callers must not change the result."""
    if isinstance(token_ids, PromptTokens):
        return token_ids.block_hashes(block_size)
    return prompt_block_hashes(token_ids, block_size)


def known_block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...] | None:
    """The hashes `block_hashes_of` would give, when they cost nothing to get (PromptTokens)."""
    if isinstance(token_ids, PromptTokens):
        return token_ids.block_hashes(block_size)
    return None
