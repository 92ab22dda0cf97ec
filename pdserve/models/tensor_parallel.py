"""Tensor parallelism in the model: `TensorParallel` (this process's rank in a torch.distributed
group: Gloo on CPU, NCCL on CUDA) and the layers that communicate through it, following the
layout of tp_layout.py. A model built without one (TP 1) uses none of these: its layers are the
plain ones, untouched.

Every rank runs the same forward on the same inputs, so every rank calls the same collectives in
the same order; after each all-reduce and all-gather all ranks hold the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.models.linear import Linear
from pdserve.models.meta_init import uninitialized
from pdserve.models.tp_layout import ShardLayout


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size` ranks that together run one model; `group` the torch.distributed
    process group of those ranks (None: the default group). `own_device`: see below."""

    rank: int
    size: int
    group: Any = None
    # Each rank's process sees only its own device (a Ray rank actor given one GPU): its
    # device is "cuda" of its own view, and the placement group, not this process's device
    # count, guarantees a device per rank.
    own_device: bool = False
    # Mixture-of-experts layers dispatch each rank's share of the tokens to the experts' ranks
    # with all_to_all (--expert-parallel; expert_dispatch.py) instead of every rank running its
    # experts on every token and all-reducing.
    expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (x: contiguous)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x concatenated along the last dimension, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x (each the same shape) stacked along the first dimension, in rank
        order: [size * rows, ...]."""
        x = x.contiguous()
        whole = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        dist.all_gather(list(whole.tensor_split(self.size)), x, group=self.group)
        return whole

    def all_to_all_rows(
        self, x: torch.Tensor, send_rows: list[int], receive_rows: list[int]
    ) -> torch.Tensor:
        """Rows send_rows[r] of x (consecutive, in rank order) go to rank r; returns the rows
        received, receive_rows[r] from rank r, in rank order."""
        out = x.new_empty(sum(receive_rows), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive_rows, send_rows, group=self.group)
        return out


class RowParallelLinear(Linear):
    """A Linear over this rank's input columns (o_proj, down_proj), summed over the ranks: the
    ranks' partial products add up to the whole product. The bias lives on rank 0 only, so the
    sum adds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias and tp.rank == 0)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x).contiguous())


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding: each rank looks up the tokens in its shard, zero
    elsewhere, and the all-reduce sums the one rank's row per token."""

    def __init__(self, layout: ShardLayout, hidden: int, tp: TensorParallel) -> None:
        rows = layout.vocab_per_rank
        super().__init__(rows, hidden, _weight=uninitialized(rows, hidden))
        self.first, self.end = layout.vocab_rows
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.first
        elsewhere = (input_ids < self.first) | (input_ids >= self.end)
        x = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(elsewhere.unsqueeze(-1), 0))


class VocabParallelHead(Linear):
    """This rank's rows of the LM head; the ranks' logits gathered in rank order, the padding
    of the last shard cut off: every rank gets the whole vocabulary's logits."""

    def __init__(self, layout: ShardLayout, hidden: int, tp: TensorParallel) -> None:
        super().__init__(hidden, layout.vocab_per_rank, bias=False)
        self.vocab_size = layout.vocab_size
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        return self.tp.all_gather_last(super().forward(x))[..., : self.vocab_size]
