"""Paged attention as one opaque torch op, `pdserve::paged_attention`, for compiled decode
graphs (pdserve/engine/gpu_step/compiled_decode.py).

Traced as plain torch, the in-place store of new K/V into a view of the cache makes the compiler
functionalize it: it copies the whole KV cache per layer to write a few slots. As a custom op
that declares the layer cache mutated, the store and the attention (a block gather, or a kernel
reading the blocks in place) stay inside one call and the compiled graph writes the cache in
place, like vLLM's attention op.
"""

from __future__ import annotations

import torch

from pdserve.models.attention import AttentionContext, paged_attention


@torch.library.custom_op("pdserve::paged_attention", mutates_args=("layer_cache",))
def paged_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    attn_mask: torch.Tensor | None,
    context_lens: torch.Tensor | None,
) -> torch.Tensor:
    ctx = AttentionContext(
        slot_mapping, block_tables, attn_mask, None, None, context_lens=context_lens
    )
    return paged_attention(q, k, v, layer_cache, ctx)


@paged_attention_op.register_fake
def _(q, k, v, layer_cache, slot_mapping, block_tables, attn_mask, context_lens) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def compiled_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    ctx: AttentionContext,
) -> torch.Tensor:
    """`paged_attention` of a decode step (one query per sequence) through the opaque op."""
    if ctx.query_index is not None or getattr(ctx, "groups", None):
        raise ValueError("compiled paged attention takes decode steps only (one query each)")
    return paged_attention_op(
        q, k, v, layer_cache, ctx.slot_mapping, ctx.block_tables, ctx.attn_mask, ctx.context_lens
    )
