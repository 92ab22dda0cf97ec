"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral): math only.

Routing is transformers' for all three: softmax over every expert's router logit (float32),
the top k, renormalized to sum to 1 when `norm_topk_prob` (Mixtral always), cast to the
activations' dtype. Each expert is a gated MLP like the dense one; Qwen2-MoE adds a shared
expert every token goes through, scaled by sigmoid(shared_expert_gate(x)).

The experts run grouped by expert, never token by token: the (token, expert) pairs are sorted by
expert, so each expert's rows are one contiguous slice, and each expert multiplies its slice
once (torch._grouped_mm on CPU: one call for all experts; elsewhere one matmul per expert that
some token chose). Experts no token chose cost nothing. The weighted outputs are scatter-added
back to their tokens.

Under tensor parallelism each rank holds disjoint experts (tp_layout.py) and the router, and by
default every rank routes every token alike, runs only the pairs of its own experts, and the
all-reduce sums the ranks' partial outputs (the tokens are already on every rank, so this
all-reduce is the combine, and no dispatch is needed). With --expert-parallel
(TensorParallel.expert_parallel) each rank instead routes its share of the tokens and sends the
pairs to their experts' ranks with all_to_all (expert_dispatch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.models import linear_kernels
from pdserve.models.cpu_features import cpu_features
from pdserve.models.expert_dispatch import dispatched_forward
from pdserve.models.linear import Linear
from pdserve.models.linear_kernels import ONEDNN, pack
from pdserve.models.tensor_parallel import TensorParallel

# torch's grouped GEMM: one kernel over every expert's slice, offsets on the device (no host
# sync). Measured on this CPU alike or faster than a loop of F.linear at 8-128 experts.
_GROUPED_MM = getattr(torch, "_grouped_mm", None)


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0 = none
    sparse_layers: tuple[int, ...] = ()  # decoder layers whose MLP is this block


class Experts(nn.Module):
    """Every expert's gated-MLP weights as one tensor each, input dimension first:
    gate_up_proj [E, hidden, 2 * inner] (gate columns first), down_proj [E, inner, hidden].
    That is transformers 5's layout transposed (the loader transposes): x @ W[e] is then the
    plain product, which the CPU GEMMs run ~1.5x faster at a few rows per expert than
    x @ W[e]^T (measured: 15 experts of 512 x 512, 128 rows, 1 thread: 3.3 ms against 5.0)."""

    def __init__(self, num_experts: int, hidden: int, inner: int, act: Callable) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inner))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.act = act

    _packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    _packed_of: tuple | None = None  # the weights' (data_ptr, version, dtype) when packed

    def forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x: [P, hidden], rows sorted by expert; ends: [E] int32, the end row of each expert's
        slice (cumulative counts). Returns [P, hidden], each row through its expert."""
        packed = self._packed_weights(x)
        if packed is not None:
            return self._forward_packed(x, ends, packed)
        gate, up = _grouped_linear(x, self.gate_up_proj, ends).chunk(2, dim=-1)
        return _grouped_linear(self.act(gate) * up, self.down_proj, ends)

    def _forward_packed(self, x, ends, packed) -> torch.Tensor:
        """`forward` through oneDNN over each expert's reordered weights (linear_kernels.py: at a few
        rows ~2x faster than the MKL GEMM under torch.mm, which packs the weight again on
        every call), one pair of calls per expert that some row chose."""
        out = x.new_empty(x.shape[0], self.down_proj.shape[2])
        start = 0
        for expert, end in enumerate(ends.tolist()):  # one host sync per call
            if end > start:
                gate_up, down = packed[expert]
                gate, up = linear_kernels.packed(x[start:end], None, None, gate_up).chunk(2, -1)
                out[start:end] = linear_kernels.packed(self.act(gate) * up, None, None, down)
            start = end
        return out

    def _packed_weights(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each expert's weights reordered for oneDNN, made on first use and again when the
        weights change; None where oneDNN does not apply (as in linear.Linear)."""
        w = self.gate_up_proj
        applies = (
            ONEDNN
            and x.device.type == "cpu"
            and x.dtype == w.dtype
            and (
                w.dtype == torch.float32
                or (w.dtype == torch.bfloat16 and cpu_features().runs_bf16_packed)
            )
            and not torch.compiler.is_compiling()
            and not (w.requires_grad and torch.is_grad_enabled())
        )
        if not applies:
            return None
        key = (w.data_ptr(), w._version, self.down_proj.data_ptr(), self.down_proj._version)
        if self._packed_of != key:
            self._packed = [
                (pack(w[e].t().contiguous()), pack(self.down_proj[e].t().contiguous()))
                for e in range(w.shape[0])
            ]
            self._packed_of = key
        return self._packed


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e - 1], ends[e]) of x times weight[e], for every expert e.
    x: [P, in]; weight: [E, in, out] -> [P, out]."""
    if _GROUPED_MM is not None and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _GROUPED_MM(x, weight, offs=ends)
    out = x.new_empty(x.shape[0], weight.shape[2])
    start = 0
    for expert, end in enumerate(ends.tolist()):  # one host sync per call
        if end > start:
            torch.mm(x[start:end], weight[expert], out=out[start:end])
        start = end
    return out


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer. `shared_expert`: Qwen2-MoE's dense MLP every token
    also goes through (with its sigmoid gate); None for Qwen3-MoE and Mixtral, and on ranks
    other than 0 unless expert-parallel (every rank then runs it on its share of the tokens).
    `tp`: this rank holds the experts [first_expert, end_expert) only."""

    def __init__(
        self,
        hidden: int,
        moe: MoeConfig,
        act: Callable,
        shared_expert: nn.Module | None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.tp = tp
        e = moe.num_experts
        self.first_expert, end = (
            (tp.rank * e // tp.size, (tp.rank + 1) * e // tp.size) if tp else (0, e)
        )
        self.num_local_experts = end - self.first_expert
        self.gate = Linear(hidden, e, bias=False)  # the router, whole on every rank
        # Tokens routed to each expert (all ranks' experts: every rank routes every token)
        # since the model was loaded, for the load per expert an operator watches
        # (routed_tokens_per_layer). A buffer updated in place, so compiled graphs keep it.
        self.register_buffer("routed_tokens", torch.zeros(e, dtype=torch.int64), persistent=False)
        self.experts = Experts(self.num_local_experts, hidden, moe.intermediate_size, act)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] (int64) and their weights [T, k] (x's dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.tp is not None and self.tp.expert_parallel:
            return dispatched_forward(self, x)
        experts, weights = self.route(x)
        pairs, weights = experts.flatten(), weights.flatten()  # [T * k], token-major
        self.routed_tokens += torch.bincount(pairs, minlength=self.gate.out_features)
        token_of_pair = None  # pair p belongs to token p // k
        if self.tp is not None:  # this rank's experts' pairs only, numbered from 0
            pairs = pairs - self.first_expert
            mine = ((pairs >= 0) & (pairs < self.num_local_experts)).nonzero().squeeze(1)
            pairs, weights, token_of_pair = pairs[mine], weights[mine], mine // self.top_k
        order = pairs.argsort(stable=True)  # pairs grouped by expert
        # the token of each sorted pair
        tokens = order // self.top_k if token_of_pair is None else token_of_pair[order]
        counts = torch.bincount(pairs, minlength=self.num_local_experts)
        out_rows = self.experts(x.index_select(0, tokens), counts.cumsum(0, dtype=torch.int32))
        out_rows.mul_(weights[order].unsqueeze(1))
        out = torch.zeros_like(x).index_add_(0, tokens, out_rows)
        if self.shared_expert is not None:
            shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
            out = out + shared
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


def routed_tokens_per_layer(model: nn.Module) -> list[list[int]]:
    """Tokens routed to each expert of each sparse layer since load (one device sync); [] for
    a dense model."""
    counts = [m.routed_tokens for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return torch.stack(counts).tolist() if counts else []


def reset_routed_tokens(model: nn.Module) -> None:
    """Zeroes the counts (after the loader materializes a model built on the meta device,
    whose buffers hold whatever memory they got)."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.routed_tokens.zero_()
