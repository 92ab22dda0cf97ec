"""A step's `AttentionContext` from its sequences: where each one's new tokens start, how many
there are, its block table. Built once per step; every layer reuses it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.models.attention import AttentionContext, AttentionGroup, length_groups


@dataclass
class _Padded:
    """Some sequences of the step padded to their longest query and context."""

    query_index: torch.Tensor  # [B, Q]
    valid: torch.Tensor  # [B * Q] bool
    block_tables: torch.Tensor  # [B, max_blocks]
    attn_mask: torch.Tensor  # [B, 1, Q, max_blocks * block_size]


def attention_context(
    starts: list[int],  # per sequence: position of its first new token
    lens: list[int],  # per sequence: new tokens (>= 1), packed in this order
    tables: list[list[int]],
    slots: list[int],  # per packed token: kv-cache slot
    block_size: int,
    device: torch.device,
) -> AttentionContext:
    firsts = [0] * len(lens)
    for i in range(1, len(lens)):
        firsts[i] = firsts[i - 1] + lens[i - 1]
    num_blocks = [-(-(s + n) // block_size) for s, n in zip(starts, lens, strict=True)]
    every = _padded(range(len(lens)), starts, lens, firsts, tables, num_blocks, block_size)
    num_q = max(lens)
    query_index = unpad_index = None
    if num_q > 1:
        query_index = every.query_index.to(device)
        unpad_index = torch.nonzero(every.valid).squeeze(1).to(device)
    return AttentionContext(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=every.block_tables.to(device),
        attn_mask=every.attn_mask.to(device),
        query_index=query_index,
        unpad_index=unpad_index,
        groups=_groups(starts, lens, firsts, tables, num_blocks, block_size, device),
    )


def _groups(starts, lens, firsts, tables, num_blocks, block_size, device):
    """Single-token sequences by length (attention.length_groups), multi-token ones together;
    None when that makes one group."""
    single = [i for i, n in enumerate(lens) if n == 1]
    multi = [i for i, n in enumerate(lens) if n > 1]
    members = [[single[j] for j in g] for g in length_groups([num_blocks[i] for i in single])]
    if multi:
        members.append(multi)
    if len(members) == 1:
        return None
    groups = []
    for seqs in members:
        p = _padded(seqs, starts, lens, firsts, tables, num_blocks, block_size)
        groups.append(
            AttentionGroup(
                query_index=p.query_index.to(device),
                out_rows=p.query_index.flatten()[p.valid].to(device),
                valid_index=None if p.valid.all() else torch.nonzero(p.valid).squeeze(1).to(device),
                block_tables=p.block_tables.to(device),
                attn_mask=p.attn_mask.to(device),
            )
        )
    return groups


def _padded(seqs, starts, lens, firsts, tables, num_blocks, block_size) -> _Padded:
    seqs = list(seqs)
    num_q = max(lens[i] for i in seqs)
    width = max(num_blocks[i] for i in seqs)
    padded = [tables[i][:width] + [0] * (width - len(tables[i][:width])) for i in seqs]
    start = torch.tensor([starts[i] for i in seqs], dtype=torch.int64)
    length = torch.tensor([lens[i] for i in seqs], dtype=torch.int64)
    first = torch.tensor([firsts[i] for i in seqs], dtype=torch.int64)
    offs = torch.arange(num_q)[None, :]
    # Query i of sequence b sits at position start_b + i and sees keys 0..that position.
    q_pos = start[:, None] + offs  # [B, Q]
    key_pos = torch.arange(width * block_size)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [B, 1, Q, S]
    # Padding rows repeat the sequence's last token; their outputs are dropped.
    query_index = first[:, None] + torch.minimum(offs, length[:, None] - 1)
    valid = (offs < length[:, None]).flatten()
    return _Padded(query_index, valid, torch.tensor(padded, dtype=torch.int64), mask)
