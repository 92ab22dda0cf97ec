"""Paged attention in plain torch: write new K/V by slot, read each sequence's blocks by table.

A step whose sequences differ widely attends in groups (`AttentionGroup`): single-token
(decode) sequences by similar context length (`length_groups`), multi-token ones (prefill
chunks, drafts) apart, so no sequence is padded to another's query length or to a much longer
context: the gather copies, and attention reads, about each sequence's own context. Decode
sequences that fork one prefix's blocks (beams, n choices) may be one row of a group each
family: a pseudo-sequence whose queries are the members' tokens and whose mask gives each its
own blocks past the shared ones (pdserve/engine/gpu_step/attention_batch.py), so the shared
blocks are gathered once per family.

Plain decode rows skip the gather: a kernel reads their blocks where they lie, each row over its
own context (on CPU a C++ kernel, native_attention.py; on a GPU a Triton one,
triton_attention.py), so they need no length groups or families (the step's builder then sets
`context_lens` instead).

The model sees one `AttentionContext` per forward pass, built by the engine's model runner;
the model itself never sees sequences, schedulers or block managers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.models import native_attention, triton_attention

# Decode sequences are split into groups by context length when a cut spares the
# gather and attention of at least this many padding blocks (one group per layer costs a few
# more ops, worth about this many blocks of a small model's KV on CPU).
MIN_SPARED_BLOCKS = 16


@dataclass
class AttentionGroup:
    """Sequences of a step attended together, padded to the group's longest query and context
    instead of the whole batch's: Gq = the group's longest query. A row may also be a
    shared-prefix family (its members' queries over the shared blocks and each one's own)."""

    # [G, Gq] int64 packed row per (seq, query); padding repeats. None when read in place
    query_index: torch.Tensor | None
    out_rows: torch.Tensor  # [V] int64 packed row of each valid (seq, query), in [G * Gq] order
    valid_index: torch.Tensor | None  # [V] int64 valid entries of the [G * Gq] layout; None: all
    block_tables: torch.Tensor  # [G, group_max_blocks] int64, padded with block 0
    attn_mask: torch.Tensor | None  # [G, 1, Gq, group_max_blocks * block_size] bool; None: in place
    # [G] int64, set when the group's rows are plain decode sequences (Gq = 1) read in place
    # (`read_in_place`): row g attends over its first context_lens[g] slots. None: gathered and
    # attended with the mask.
    context_lens: torch.Tensor | None = None


def reads_in_place(device: torch.device, head_dim: int, block_size: int) -> bool:
    """Whether decode rows on `device` can be read in place (`read_in_place`)."""
    if device.type == "cpu":
        return native_attention.enabled()
    if device.type == "cuda":
        return triton_attention.enabled() and triton_attention.supports(head_dim, block_size)
    return False


def read_in_place(
    q: torch.Tensor,  # [B, H, D], one query per sequence (rope applied)
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64: sequence b attends over its first slots
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [B, H * D]
    """Decode attention through the kernel of q's device, reading the KV blocks where they lie.
    `new_kv` = (k, v, slot_mapping): each row's newest key and value, not yet in the cache
    (their slots are each context's last). The CPU stores them first; the GPU kernel stores
    them as it attends, one launch instead of two index copies and itself."""
    if q.device.type == "cpu":
        if new_kv is not None:
            store_kv(*new_kv[:2], layer_cache, new_kv[2])
        return native_attention.paged_decode_attention(q, layer_cache, block_tables, context_lens)
    return triton_attention.paged_decode_attention(
        q, layer_cache, block_tables, context_lens, new_kv
    )


def length_groups(num_blocks: list[int]) -> list[list[int]]:
    """Indices of `num_blocks` (blocks each sequence attends over) in groups: sorted longest
    first, cut before a sequence when padding every sequence from it on to the current group's
    longest would cost MIN_SPARED_BLOCKS or more and the sequence needs at most 3/4 of those
    blocks. Uniform lengths stay one group."""
    order = sorted(range(len(num_blocks)), key=lambda i: -num_blocks[i])
    groups: list[list[int]] = []
    longest = 0
    for rank, i in enumerate(order):
        n = num_blocks[i]
        remaining = len(order) - rank
        if not groups or ((longest - n) * remaining >= MIN_SPARED_BLOCKS and 4 * n <= 3 * longest):
            groups.append([])
            longest = n
        groups[-1].append(i)
    return groups


@dataclass
class AttentionContext:
    """Per-step metadata. T = new tokens in the step (packed), B = sequences, Q = longest query.

    Sequence b's new tokens are the packed rows `query_index[b, :query_len[b]]`; its keys are
    the first `context_len[b]` slots of its block table (cached prefix + the new tokens).
    """

    slot_mapping: torch.Tensor  # [T] int64: kv-cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (masked out)
    # [B, 1, Q, max_blocks * block_size] bool: True = may attend; None when read in place
    attn_mask: torch.Tensor | None
    query_index: torch.Tensor | None  # [B, Q] int64 packed row per (seq, query); None when Q == 1
    unpad_index: torch.Tensor | None  # [T] int64 row of each packed token in the [B * Q] layout
    # When set, attention runs group by group instead (the fields above still describe the
    # whole batch): sequences with one new token by similar context length, those with more
    # (prefill chunks, drafts) apart, so none is padded to another's query or much longer context.
    groups: list[AttentionGroup] | None = None
    # [B] int64, set when every sequence is a plain decode one (Q = 1) and is read in place
    # (`read_in_place`): sequence b attends over its first context_lens[b] slots. None: gathered
    # and attended with the mask.
    context_lens: torch.Tensor | None = None


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (rope applied)
    k: torch.Tensor,  # [T, KV, D] (rope applied)
    v: torch.Tensor,  # [T, KV, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D], this layer's K and V
    ctx: AttentionContext,
) -> torch.Tensor:  # [T, H * D]
    if ctx.context_lens is not None:  # plain decode rows: the kernel's side stores K/V
        new_kv = (k, v, ctx.slot_mapping)
        return read_in_place(q, layer_cache, ctx.block_tables, ctx.context_lens, new_kv)
    # Store first, so a sequence's new tokens see themselves through the same gather.
    store_kv(k, v, layer_cache, ctx.slot_mapping)
    return attend_stored(q, layer_cache, ctx)


def store_kv(
    k: torch.Tensor,  # [T, KV, D] (rope applied)
    v: torch.Tensor,  # [T, KV, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Writes each new token's key and value into its slot of the layer cache."""
    flat = layer_cache.view(2, -1, k.shape[1], k.shape[2])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def attend_stored(
    q: torch.Tensor,  # [T, H, D] (rope applied)
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D], the step's K/V stored
    ctx: AttentionContext,
) -> torch.Tensor:  # [T, H * D]
    """`paged_attention` once the step's keys and values are in the cache (`store_kv`, or
    native_ops.rope_store_kv on CPU)."""
    head_dim = layer_cache.shape[-1]
    if ctx.groups is not None:
        out = q.new_empty(q.shape[0], q.shape[1] * head_dim)
        for g in ctx.groups:
            if g.context_lens is not None:
                rows = read_in_place(q[g.out_rows], layer_cache, g.block_tables, g.context_lens)
            else:
                rows = _attend(q[g.query_index], layer_cache, g.block_tables, g.attn_mask)
                rows = rows if g.valid_index is None else rows[g.valid_index]
            out.index_copy_(0, g.out_rows, rows)
        return out
    if ctx.context_lens is not None:
        return read_in_place(q, layer_cache, ctx.block_tables, ctx.context_lens)
    out = _attend(
        q if ctx.query_index is None else q[ctx.query_index],
        layer_cache,
        ctx.block_tables,
        ctx.attn_mask,
    )
    return out if ctx.unpad_index is None else out[ctx.unpad_index]


def _attend(
    qp: torch.Tensor,  # [B, Q, H, D] or, with Q == 1, [B, H, D]
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    mask: torch.Tensor,  # [B, 1, Q, max_blocks * block_size]
) -> torch.Tensor:  # [B * Q, H * D]
    """Attention of B sequences' queries over their blocks."""
    num_kv_heads, head_dim = layer_cache.shape[-2], layer_cache.shape[-1]
    group = qp.shape[-2] // num_kv_heads
    # One gather for these sequences, through a head-major view of the pool ([2, KV, blocks,
    # block_size, D]; index_select copies whole blocks, several times faster than advanced
    # indexing), so each KV head's keys come out contiguous for all sequences at once:
    # [2, KV, B, S, D]. SDPA then takes the KV heads as its batch and the sequences as its heads
    # and reads K/V as they are; gathered sequence-major, SDPA copied them again.
    batch = block_tables.shape[0]
    kv = layer_cache.permute(0, 3, 1, 2, 4).index_select(2, block_tables.view(-1))
    kv = kv.view(2, num_kv_heads, batch, -1, head_dim)

    qp = qp.reshape(batch, -1, num_kv_heads, group, head_dim)  # [B, Q, KV, G, D]
    num_q = qp.shape[1]
    # Grouped-query attention without repeating K/V: a KV head's G query heads become G * Q
    # query rows of that head (the mask is repeated to match): [KV, B, G * Q, D].
    qp = qp.permute(2, 0, 3, 1, 4).reshape(num_kv_heads, batch, group * num_q, head_dim)
    # mask: [B, 1, Q, S]; with Q == 1 it broadcasts over the G rows
    if group > 1 and num_q > 1:
        mask = mask.repeat(1, 1, group, 1)
    # [1, B, G * Q, S]: the same mask for every KV head
    out = F.scaled_dot_product_attention(qp, kv[0], kv[1], attn_mask=mask.transpose(0, 1))
    out = out.view(num_kv_heads, batch, group, num_q, head_dim).permute(1, 3, 0, 2, 4)
    return out.reshape(batch * num_q, -1)
