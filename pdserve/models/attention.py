"""Paged attention in plain torch: write new K/V by slot, read each sequence's blocks by table.

The model sees one `AttentionContext` per forward pass, built by the engine's model runner;
the model itself never sees sequences, schedulers or block managers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionContext:
    """Per-step metadata. T = new tokens in the step (packed), B = sequences, Q = longest query.

    Sequence b's new tokens are the packed rows `query_index[b, :query_len[b]]`; its keys are
    the first `context_len[b]` slots of its block table (cached prefix + the new tokens).
    """

    slot_mapping: torch.Tensor  # [T] int64: kv-cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (masked out)
    attn_mask: torch.Tensor  # [B, 1, Q, max_blocks * block_size] bool: True = may attend
    query_index: torch.Tensor | None  # [B, Q] int64 packed row per (seq, query); None when Q == 1
    unpad_index: torch.Tensor | None  # [T] int64 row of each packed token in the [B * Q] layout


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (rope applied)
    k: torch.Tensor,  # [T, KV, D] (rope applied)
    v: torch.Tensor,  # [T, KV, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D], this layer's K and V
    ctx: AttentionContext,
) -> torch.Tensor:  # [T, H * D]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    # Store first, so a sequence's new tokens see themselves through the same gather.
    flat = layer_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0].index_copy_(0, ctx.slot_mapping, k)
    flat[1].index_copy_(0, ctx.slot_mapping, v)

    # One gather for the whole batch (index_select copies whole blocks; several times faster
    # than advanced indexing): [2, B * max_blocks, block_size, KV, D].
    batch = ctx.block_tables.shape[0]
    kv = layer_cache.index_select(1, ctx.block_tables.view(-1))
    kv = kv.view(2, batch, -1, num_kv_heads, head_dim).transpose(2, 3)  # [2, B, KV, S, D]

    qp = q if ctx.query_index is None else q[ctx.query_index]  # [B, Q, H, D] or [T=B, H, D]
    qp = qp.reshape(batch, -1, num_kv_heads, group, head_dim)  # [B, Q, KV, G, D]
    num_q = qp.shape[1]
    # Grouped-query attention without repeating K/V: a KV head's G query heads become G * Q
    # query rows of that head (the mask is repeated to match).
    qp = qp.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * num_q, head_dim)
    mask = ctx.attn_mask  # [B, 1, Q, S]; with Q == 1 it broadcasts over the G rows
    if group > 1 and num_q > 1:
        mask = mask.repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(qp, kv[0], kv[1], attn_mask=mask)
    out = out.view(batch, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch * num_q, -1)  # [B * Q, H * D]
    return out if ctx.unpad_index is None else out[ctx.unpad_index]
