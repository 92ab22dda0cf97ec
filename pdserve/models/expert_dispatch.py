"""Expert parallelism with all_to_all (--expert-parallel): a mixture-of-experts layer whose
tokens travel to the ranks that hold their experts, the way DeepEP/SGLang run EP beside
tensor-parallel attention.

Every rank enters the layer with the whole step's tokens (attention's all-reduce gave them to
all). Rank r takes its share, the rows [r * S, (r + 1) * S) with S = ceil(T / N) (the last
shares short or empty), routes them, and:

1. all-gathers each rank's count of (token, expert) pairs per expert, so every rank knows how
   many rows it sends to and receives from each rank (and the expert-load metric counts each
   token once);
2. dispatches its pairs, sorted by expert (so by owning rank), with all_to_all;
3. runs the rows it received through its experts, grouped by expert (moe.Experts);
4. returns the outputs with a second all_to_all, into the order it sent them;
5. weights and sums each token's expert outputs on the token's home rank exactly as one rank
   does (the same sorted order, the same index_add_), adds Qwen2-MoE's shared expert (every
   rank holds it whole and runs it on its own share);
6. all-gathers the ranks' shares, padded to S rows, so every rank has the whole batch again.

Every rank holds disjoint experts (tp_layout.py: [r * E // N, (r + 1) * E // N)), so N need
not divide the expert count.
"""

from __future__ import annotations

import torch
from torch import nn


def dispatched_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """moe.SparseMoeBlock's forward under expert parallelism; x: [T, hidden], the same on every
    rank of block.tp -> [T, hidden], the same on every rank."""
    tp, k = block.tp, block.top_k
    num_experts = block.gate.out_features
    share = -(-x.shape[0] // tp.size)
    mine = x[min(tp.rank * share, x.shape[0]) : (tp.rank + 1) * share]

    experts, weights = block.route(mine)
    pairs, weights = experts.flatten(), weights.flatten()  # [t * k], token-major
    order = pairs.argsort(stable=True)  # by expert, hence by the rank that holds it
    tokens = order // k  # the local token of each sorted pair
    counts = tp.all_gather_rows(torch.bincount(pairs, minlength=num_experts)[None])  # [N, E]
    block.routed_tokens += counts.sum(0)

    bounds = [r * num_experts // tp.size for r in range(tp.size + 1)]
    first, end = bounds[tp.rank], bounds[tp.rank + 1]
    # [N senders, N receivers]: pairs each rank sends each rank (one host sync)
    per_rank = torch.stack(
        [counts[:, a:b].sum(1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=1
    ).tolist()
    send_rows = per_rank[tp.rank]
    receive_rows = [row[tp.rank] for row in per_rank]

    received = tp.all_to_all_rows(mine.index_select(0, tokens), send_rows, receive_rows)
    outputs = _run_own_experts(block.experts, received, counts[:, first:end])
    returned = tp.all_to_all_rows(outputs, receive_rows, send_rows)

    returned.mul_(weights[order].unsqueeze(1))
    out = torch.zeros_like(mine).index_add_(0, tokens, returned)
    if block.shared_expert is not None:
        out = out + block.shared_expert(mine) * torch.sigmoid(block.shared_expert_gate(mine))
    padded = torch.cat([out, out.new_zeros(share - out.shape[0], out.shape[1])])
    return tp.all_gather_rows(padded)[: x.shape[0]]


def _run_own_experts(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows: what this rank received, each sender's block sorted by expert; counts [N, E_local]:
    rows each sender sent each of this rank's experts. Returns each row through its expert, in
    the order received."""
    if rows.shape[0] == 0:
        return rows
    local = torch.arange(counts.shape[1], device=rows.device).repeat(counts.shape[0])
    regroup = local.repeat_interleave(counts.flatten()).argsort(stable=True)
    grouped = experts(rows.index_select(0, regroup), counts.sum(0).cumsum(0, dtype=torch.int32))
    return torch.empty_like(rows).index_copy_(0, regroup, grouped)
