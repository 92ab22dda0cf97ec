"""Which KV heads each prefill rank sends to which decode rank, when prefill and decode are
tensor-parallel workers (of any degrees N and M, equal or not).

Rank r of N holds the KV heads `kv_head_range(H, r, N)` (pdserve/models/tp_layout.py): an even
split, or with fewer heads than ranks one head shared by N / H consecutive ranks. A handoff
sends each decode rank exactly the heads its cache holds, straight from a prefill rank that
holds them: nothing is gathered on rank 0, and no rank sends heads another rank sends.
- A head several prefill ranks hold is sent by the first of them (each head's bytes once).
- A prefill rank whose heads span several decode ranks sends each its part; a decode rank
  whose heads span several prefill ranks receives a part from each.
- A head several decode ranks hold (M > H) goes to each of them: every decode rank's cache
  needs its copy, and the decode ranks have no hop of their own to copy it on.
So the bytes on the wire equal the KV's size when M <= H, and M / H times it otherwise.

Pure arithmetic, plus the two tensor views a rank reads and writes its part through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.models.tp_layout import kv_head_range

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HeadSlice:
    """KV heads [first_head, end_head) of the model, for decode rank `decode_rank`."""

    decode_rank: int
    first_head: int
    end_head: int


def slices_to_send(
    total_kv_heads: int, prefill_rank: int, prefill_tp: int, decode_tp: int
) -> list[HeadSlice]:
    """What prefill rank `prefill_rank` of `prefill_tp` sends to a `decode_tp`-rank worker."""
    first, end = kv_head_range(total_kv_heads, prefill_rank, prefill_tp)
    if prefill_rank > 0:  # heads an earlier rank holds too are that rank's to send
        first = max(first, kv_head_range(total_kv_heads, prefill_rank - 1, prefill_tp)[1])
    slices = []
    for decode_rank in range(decode_tp):
        held_first, held_end = kv_head_range(total_kv_heads, decode_rank, decode_tp)
        lo, hi = max(first, held_first), min(end, held_end)
        if lo < hi:
            slices.append(HeadSlice(decode_rank, lo, hi))
    return slices


def read_heads(
    kv_cache: torch.Tensor, block_ids: list[int], layers: tuple[int, int], heads: tuple[int, int]
) -> torch.Tensor:
    """A contiguous copy of kv_cache[l0:l1, :, block_ids, :, h0:h1] (heads: the cache's own
    indices), in one copy."""
    import torch

    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    return kv_cache[layers[0] : layers[1], :, :, :, heads[0] : heads[1]].index_select(2, index)
