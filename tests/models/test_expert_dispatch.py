"""--expert-parallel's all_to_all dispatch and combine (expert_dispatch.py) on one MoE layer,
against the same layer whole on one rank: each rank of a Gloo group (spawned processes) holds
its experts only, and every rank's output equals the one-rank output for token counts that do
not divide by the ranks (1 token: only rank 0 routes; 0 rows on the short ranks), with a router
that never picks the last two experts (at TP 4 rank 3 holds just those and receives nothing),
and the expert-load counts are the one-rank counts (each token counted once, not per rank)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.bench.common.spawned_ranks import run_on_ranks
from pdserve.models.moe import MoeConfig, SparseMoeBlock
from pdserve.models.tensor_parallel import TensorParallel

HIDDEN, EXPERTS, UNCHOSEN = 16, 7, 2  # the last UNCHOSEN experts get no token
TOKEN_COUNTS = (1, 3, 5, 13, 2)


def _layer(tp: TensorParallel | None, top_k: int, shared: bool) -> SparseMoeBlock:
    """The same random layer on every rank (one seed), holding tp's experts. Inputs are positive
    (`_inputs`) and the router's rows of the last UNCHOSEN experts negative: their logits are
    the lowest, so no token picks them."""
    moe = MoeConfig(EXPERTS, top_k, intermediate_size=8, norm_topk_prob=top_k > 1)
    generator = torch.Generator().manual_seed(11)
    block = SparseMoeBlock(HIDDEN, moe, F.silu, nn.Linear(HIDDEN, HIDDEN) if shared else None, tp)
    with torch.no_grad():
        gate = torch.rand(EXPERTS, HIDDEN, generator=generator)
        gate[-UNCHOSEN:] *= -1
        block.gate.weight.copy_(gate)
        whole_gate_up = torch.randn(EXPERTS, HIDDEN, 16, generator=generator) / 4
        whole_down = torch.randn(EXPERTS, 8, HIDDEN, generator=generator) / 4
        first = block.first_expert
        block.experts.gate_up_proj.copy_(whole_gate_up[first : first + block.num_local_experts])
        block.experts.down_proj.copy_(whole_down[first : first + block.num_local_experts])
        block.routed_tokens.zero_()
        if shared:
            for p in block.shared_expert.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) / 4)
            block.shared_expert_gate.weight.copy_(torch.randn(1, HIDDEN, generator=generator))
    return block


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.rand(n, HIDDEN, generator=generator) for n in TOKEN_COUNTS]


# (top_k, shared expert): Qwen2-MoE's shared expert; top-1; every expert the router can pick
LAYERS = ((2, True), (1, False), (EXPERTS - UNCHOSEN, False))


def _compare_on_rank(rank: int, size: int) -> None:
    for top_k, shared in LAYERS:
        one_rank = _layer(None, top_k, shared)
        dispatched = _layer(TensorParallel(rank, size, expert_parallel=True), top_k, shared)
        with torch.inference_mode():
            for x in _inputs():
                torch.testing.assert_close(dispatched(x), one_rank(x), atol=1e-6, rtol=0)
        assert dispatched.routed_tokens.tolist() == one_rank.routed_tokens.tolist()
        assert one_rank.routed_tokens[-UNCHOSEN:].tolist() == [0] * UNCHOSEN
        assert one_rank.routed_tokens.sum() == top_k * sum(TOKEN_COUNTS)


@pytest.mark.parametrize("size", [2, 4])
def test_dispatched_layer_equals_one_rank(size):
    run_on_ranks(size, _compare_on_rank, (), timeout_s=120)
