"""Which slice of each weight rank r of N tensor-parallel ranks holds (Megatron-LM's layout).

- Attention: query heads split evenly, contiguous ([r * H/N, (r + 1) * H/N)); KV heads split
  evenly when N divides them, else (N a multiple of KV) each rank holds the one KV head its
  query heads use, so N/KV ranks hold a copy of each. q/k/v are column-parallel (rows of the
  checkpoint's [out, in] weights), o_proj row-parallel (its columns), summed by an all-reduce.
- MLP: gate/up column-parallel over the intermediate size, down_proj row-parallel.
- Embedding and LM head: vocabulary rows in N equal shards of ceil(V / N) rows (the last one
  padded with zero rows): each rank looks up the tokens of its shard, the all-reduce sums the
  ranks' rows; each rank's LM head gives its shard's logits, gathered in rank order.
- Norms are replicated; a row-parallel bias lives on rank 0 only (added once by the sum).
- Mixture-of-experts layers are expert-parallel: rank r holds the routed experts
  [r * E // N, (r + 1) * E // N) whole (contiguous, sizes differing by one at most) and the
  router replicated; each rank runs its experts' (token, expert) pairs and the all-reduce sums
  the ranks' outputs. Qwen2-MoE's shared expert lives on rank 0 only (added once by the sum);
  under --expert-parallel (expert_dispatch.py) every rank holds it, for its share of tokens.

Pure arithmetic on head and row counts, free of torch; which degrees it can split is
`pdserve.core.model_limits.tensor_parallel_error`, the rule the configuration checks share.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.model_limits import tensor_parallel_error

# Checkpoint weights (names within a layer) split by rows (column-parallel: dimension 0) or
# columns (row-parallel: dimension 1 of the [out, in] weight); biases follow their rows.
_QUERY_ROWS = ("self_attn.q_proj",)
_KV_ROWS = ("self_attn.k_proj", "self_attn.v_proj")
_INNER_ROWS = ("mlp.gate_proj", "mlp.up_proj")
_ROW_PARALLEL = {"self_attn.o_proj": "query", "mlp.down_proj": "inner"}
_VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")
_STACKED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size`: its heads, MLP rows and vocabulary rows."""

    rank: int
    size: int
    num_heads: int  # query heads of this rank
    num_kv_heads: int  # KV heads of this rank
    total_kv_heads: int  # the model's
    head_dim: int
    intermediate: int  # MLP rows of this rank
    vocab_size: int  # the whole vocabulary
    vocab_per_rank: int  # ceil(vocab_size / size): rows of each rank's embedding and LM head
    num_experts: int = 0  # routed experts of each sparse layer, the model's (0: dense)

    @classmethod
    def of(
        cls,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        vocab_size: int,
        rank: int,
        size: int,
        num_experts: int = 0,
    ) -> ShardLayout:
        problem = tensor_parallel_error(heads, kv_heads, intermediate, size)
        if problem:
            raise ValueError(problem)
        if not 0 <= rank < size:
            raise ValueError(f"tensor parallel rank {rank} is not in [0, {size})")
        return cls(
            rank,
            size,
            heads // size,
            max(kv_heads // size, 1),
            kv_heads,
            head_dim,
            intermediate // size,
            vocab_size,
            -(-vocab_size // size),
            num_experts,
        )

    @property
    def experts(self) -> tuple[int, int]:
        """[first, end) of the routed experts this rank holds."""
        e = self.num_experts
        return self.rank * e // self.size, (self.rank + 1) * e // self.size

    @property
    def first_head(self) -> int:
        return self.rank * self.num_heads

    @property
    def first_kv_head(self) -> int:
        """This rank's first KV head; with fewer KV heads than ranks, the one its query heads
        use (size / total_kv_heads consecutive ranks share it)."""
        return kv_head_range(self.total_kv_heads, self.rank, self.size)[0]

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """[start, end) of the vocabulary this rank holds; end - start < vocab_per_rank on a
        last rank whose shard is padded."""
        start = self.rank * self.vocab_per_rank
        return min(start, self.vocab_size), min(start + self.vocab_per_rank, self.vocab_size)

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dimension, start, end) of checkpoint tensor `name` (without the `model.` prefix)
        this rank loads; None = the whole tensor. A row-parallel bias is whole (rank 0 holds
        it; the other ranks have no parameter for it)."""
        if name in _VOCAB_ROWS:
            return (0, *self.vocab_rows)
        if not name.startswith("layers."):
            return None
        if name.split(".", 2)[2] in _STACKED_EXPERTS:
            return (0, *self.experts)
        local, suffix = name.split(".", 2)[2].rsplit(".", 1)
        d = self.head_dim
        if local in _QUERY_ROWS:
            return 0, self.first_head * d, (self.first_head + self.num_heads) * d
        if local in _KV_ROWS:
            first = self.first_kv_head
            return 0, first * d, (first + self.num_kv_heads) * d
        if local in _INNER_ROWS:
            return 0, self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        if local in _ROW_PARALLEL and suffix == "weight":
            if _ROW_PARALLEL[local] == "query":
                return 1, self.first_head * d, (self.first_head + self.num_heads) * d
            return 1, self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        return None


def kv_head_range(total_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[first, end) of the model's KV heads that rank `rank` of `size` holds: an even split,
    or (fewer heads than ranks) the one head its query heads use, size / total_kv_heads
    consecutive ranks sharing it. What each rank's KV cache holds, and so what a handoff
    between tensor-parallel workers moves rank to rank (kv_transfer/head_slices.py)."""
    if total_kv_heads >= size:
        per_rank = total_kv_heads // size
        return rank * per_rank, (rank + 1) * per_rank
    first = rank // (size // total_kv_heads)
    return first, first + 1
