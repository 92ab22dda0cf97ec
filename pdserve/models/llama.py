"""The Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3, and with a mixture-of-experts
MLP in some or all layers Qwen2-MoE, Qwen3-MoE, Mixtral: moe.py): math only.

Numerics follow transformers' LlamaForCausalLM: RMSNorm and RoPE tables in float32, rotate-half
RoPE, a gated MLP (SwiGLU with the default `hidden_act`); Qwen3 also RMS-normalizes each query and
key head before RoPE (`qk_norm`). q/k/v and gate/up projections are fused
into one matmul each (the loader concatenates the checkpoint's separate weights) because fewer,
larger matmuls are faster.

Eager CPU inference runs the layers' small steps through fused C++ ops instead (native_ops.py,
the `forward_fused` methods): each residual add with the norm after it, RoPE with the K/V store,
SiLU with the product; they round where the torch formulas round. Compiled graphs, GPUs and
autograd take the torch formulas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models import native_ops
from pdserve.models.attention import AttentionContext, attend_stored, paged_attention
from pdserve.models.attention_op import compiled_paged_attention
from pdserve.models.linear import Linear
from pdserve.models.meta_init import building_on_meta, uninitialized
from pdserve.models.moe import MoeConfig, SparseMoeBlock
from pdserve.models.rope import rope_tables
from pdserve.models.tensor_parallel import (
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from pdserve.models.tp_layout import ShardLayout

# config.json `hidden_act` -> the function transformers' ACT2FN maps it to.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    # rope_type (see rope.ROPE_TYPES), rope_theta and the type's own parameters
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    qkv_bias: bool = False  # Qwen2, Llama with attention_bias
    o_proj_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False  # Llama with mlp_bias: gate, up and down projections
    hidden_act: str = "silu"  # a key of ACTIVATIONS
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before RoPE
    moe: MoeConfig | None = None  # the layers whose MLP is a mixture of experts, and its sizes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native_ops.applies(x) and self.weight.dtype == x.dtype:
            return native_ops.rms_norm(x, self.weight, self.eps)  # the same formula, one pass
        # Normalized in float32 and cast before the weight, as transformers does; the fused
        # op is one kernel where the written-out formula is six.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + cat(-x2, x1) * sin, written as x * cos + cat(x2, x1) *
    sin_signed (sin with its first half negated: the same products, one op fewer).
    x: [T, heads, D]; cos, sin_signed: [T, 1, D]."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * cos
    return out.add_(swapped.mul_(sin_signed))


def _row_parallel(
    in_features: int, out_features: int, bias: bool, tp: TensorParallel | None
) -> Linear:
    """o_proj / down_proj: a plain Linear at TP 1, else summed over the ranks."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class Attention(nn.Module):
    """config: this rank's share of the heads under tensor parallelism (`shard_config`)."""

    def __init__(self, config: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, sum(self.split), bias=config.qkv_bias)
        self.o_proj = _row_parallel(q_size, config.hidden_size, config.o_proj_bias, tp)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _project(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, (H + 2 KV) * D]
        """The fused q/k/v projection, each query and key head normalized when `qk_norm`."""
        qkv = self.qkv_proj(x)
        if not self.qk_norm:
            return qkv
        q, k, v = qkv.split(self.split, dim=-1)
        # Each head a row of its own: the norms run over head_dim only, as in transformers.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return torch.cat((q, k, v), dim=-1)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], first half negated (apply_rope)
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D]
        ctx: AttentionContext,
    ) -> torch.Tensor:  # [T, hidden]
        qk, v = self._project(x).split((self.split[0] + self.split[1], self.split[2]), dim=-1)
        # q and k heads rotated together: one RoPE over H + KV heads instead of two.
        qk = apply_rope(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # Compiled decode graphs attend through one opaque op (attention_op.py).
        attend = compiled_paged_attention if torch.compiler.is_compiling() else paged_attention
        return self.o_proj(attend(q, k, v, layer_cache, ctx))

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T] int64
        rope: tuple[torch.Tensor, torch.Tensor],  # the model's float32 rope_cos, rope_sin_signed
        layer_cache: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:  # [T, hidden]
        """`forward` through the fused CPU ops (native_ops.applies): RoPE of q and k and the
        store of k and v in one op."""
        qkv = self._project(x)
        q = native_ops.rope_store_kv(
            qkv, positions, *rope, layer_cache, ctx.slot_mapping, self.num_heads
        )
        return self.o_proj(attend_stored(q, layer_cache, ctx))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = Linear(hidden, 2 * inner, bias=bias)
        self.down_proj = _row_parallel(inner, hidden, bias, tp)
        self.act = ACTIVATIONS[config.hidden_act]
        self.silu = self.act is F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` through the fused CPU ops (native_ops.applies): SiLU and the product in
        one op; other activations as `forward`."""
        if not self.silu:
            return self.forward(x)
        return self.down_proj(native_ops.silu_and_mul(self.gate_up_proj(x)))


def _mlp(config: LlamaConfig, index: int, tp: TensorParallel | None) -> nn.Module:
    """Layer `index`'s MLP: dense, or a mixture of experts in the model's sparse layers."""
    moe = config.moe
    if moe is None or index not in moe.sparse_layers:
        return MLP(config, tp)
    act = ACTIVATIONS[config.hidden_act]
    shared = None
    # The shared expert whole on rank 0 only: the all-reduce of the experts' sum adds it once.
    # Expert-parallel ranks each run it on their own share of the tokens: every rank holds it.
    holds_shared = tp is None or tp.rank == 0 or tp.expert_parallel
    if moe.shared_expert_intermediate_size and holds_shared:
        shared = MLP(replace(config, intermediate_size=moe.shared_expert_intermediate_size))
    return SparseMoeBlock(config.hidden_size, moe, act, shared, tp)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: LlamaConfig, tp: TensorParallel | None = None, index: int = 0
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _mlp(config, index, tp)

    def forward(self, x, cos, sin, layer_cache, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, hidden], the residual stream
        h: torch.Tensor,  # input_layernorm(x), fused into the previous layer's last add
        next_norm: RMSNorm | None,  # the next layer's input norm; None after the last layer
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` through the fused CPU ops (native_ops.applies), each residual add fused
        with the norm after it: returns the new x and next_norm(x) (None without next_norm)."""
        delta = self.self_attn.forward_fused(h, positions, rope, layer_cache, ctx)
        norm = self.post_attention_layernorm
        x, h = native_ops.add_rms_norm(x, delta, norm.weight, norm.eps)
        delta = self.mlp.forward_fused(h)
        if next_norm is None:
            return x + delta, None
        return native_ops.add_rms_norm(x, delta, next_norm.weight, next_norm.eps)


def shard_layout(config: LlamaConfig, tp: TensorParallel) -> ShardLayout:
    """What rank tp.rank of tp.size holds (tp_layout.py); ValueError naming the numbers when
    the model cannot be split that way."""
    c = config
    return ShardLayout.of(
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        tp.rank,
        tp.size,
        c.moe.num_experts if c.moe else 0,
    )


class LlamaForCausalLM(nn.Module):
    """`tp`: this process is one rank of a tensor-parallel group and holds only its shard of
    each layer (tp_layout.py); None = the whole model, with plain layers (TP 1)."""

    def __init__(self, config: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config  # the whole model's, whatever this rank holds
        self.tp = tp if tp is not None and tp.size > 1 else None
        hidden = config.hidden_size
        if self.tp is None:
            layer_config = config
            self.embed_tokens = nn.Embedding(
                config.vocab_size, hidden, _weight=uninitialized(config.vocab_size, hidden)
            )
            self.lm_head = Linear(hidden, config.vocab_size, bias=False)
        else:
            layout = shard_layout(config, self.tp)
            layer_config = replace(
                config,
                num_heads=layout.num_heads,
                num_kv_heads=layout.num_kv_heads,
                intermediate_size=layout.intermediate,
            )
            self.embed_tokens = VocabParallelEmbedding(layout, hidden, self.tp)
            self.lm_head = VocabParallelHead(layout, hidden, self.tp)
        # KV heads this rank's cache holds: [num_layers, 2, blocks, block_size, kv_heads, D]
        self.kv_heads = layer_config.num_kv_heads
        self.layers = nn.ModuleList(
            DecoderLayer(layer_config, self.tp, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if not building_on_meta():  # the loader builds them once on its device
            self.reset_rope()

    def reset_rope(self, device: str | torch.device | None = None) -> None:
        """(Re)builds the RoPE tables over all positions, float32 like transformers (cast at
        use). Called again after the loader materializes a model built on the meta device."""
        c = self.config
        cos, sin = rope_tables(c.head_dim, c.max_position_embeddings, c.rope_parameters)
        half = c.head_dim // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # what apply_rope takes
        if device is not None:
            cos, sin = cos.to(device), sin.to(device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin_signed", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] packed new tokens of every sequence in the step
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, KV, D]
        ctx: AttentionContext,
    ) -> torch.Tensor:  # [T, hidden] final hidden states (before the last norm)
        return self._run(input_ids, positions, kv_cache, ctx, None, ())[0]

    def forward_with_exits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        ctx: AttentionContext,
        rows: torch.Tensor,  # [R] int64 packed rows whose early states are kept
        layers: Sequence[int],  # ascending; 0 = the embedding output, i = after decoder layer i
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden], [R, len(layers), hidden]
        """`forward`, also keeping the hidden states of `rows` after each of `layers` (for
        early-exit logits: `compute_logits` on them applies the final norm and the LM head)."""
        hidden, kept = self._run(input_ids, positions, kv_cache, ctx, rows, frozenset(layers))
        return hidden, torch.stack(kept, dim=1)

    def _run(self, input_ids, positions, kv_cache, ctx, rows, keep: frozenset[int]):
        x = self.embed_tokens(input_ids)
        if self._fuses(x):
            return self._run_fused(x, positions, kv_cache, ctx, rows, keep)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.rope_sin_signed[positions].to(x.dtype).unsqueeze(1)
        kept = [x.index_select(0, rows)] if 0 in keep else []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], ctx)
            if i + 1 in keep:
                kept.append(x.index_select(0, rows))
        return x, kept

    def _fuses(self, x: torch.Tensor) -> bool:
        """Whether this pass takes the fused CPU ops (native_ops.applies), which take the
        norms' weights in the activations' dtype and the RoPE tables in float32."""
        return (
            native_ops.applies(x)
            and self.norm.weight.dtype == x.dtype
            and self.rope_cos.dtype == torch.float32
        )

    def _run_fused(self, x, positions, kv_cache, ctx, rows, keep: frozenset[int]):
        """`_run` through the fused CPU ops: each layer's residual adds fused with the norms
        after them, RoPE with the K/V store, SiLU with the product (DecoderLayer.forward_fused)."""
        rope = (self.rope_cos, self.rope_sin_signed)
        layers = self.layers
        kept = [x.index_select(0, rows)] if 0 in keep else []
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            x, h = layer.forward_fused(x, h, next_norm, positions, rope, kv_cache[i], ctx)
            if i + 1 in keep:
                kept.append(x.index_select(0, rows))
        return x, kept

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        return self.lm_head(self.norm(hidden)).float()
