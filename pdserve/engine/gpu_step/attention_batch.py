"""A step's `AttentionContext` from its sequences: where each one's new tokens start, how many
there are, its block table. Built once per step; every layer reuses it.

Decode sequences whose block tables start with the same blocks (a request's beams or n
choices, which fork the prompt's blocks; requests that hit the same prefix-cache blocks) attend
as one pseudo-sequence each ("shared-prefix" or cascade attention, as in FlashInfer and vLLM):
its table is the shared blocks once, then every member's own blocks; its query rows are the
members' queries, and a mask lets member q see the shared blocks up to its position and only its
own blocks after them. The per-layer gather then copies the shared prompt once per family
instead of once per member.
"""

from __future__ import annotations

from dataclasses import dataclass
from os.path import commonprefix

import torch

from pdserve.engine.gpu_step.host_tensors import padded_rows
from pdserve.models.attention import AttentionContext, AttentionGroup, length_groups

# A family of decode sequences attends as one pseudo-sequence when it shares at least this
# many blocks and at least twice as many as any member owns past them. It gathers the shared
# blocks once instead of once per member, but each member's query also meets (masked) every
# other member's own blocks: below these bounds that ate most or all of what the gather
# saved (per-step attention time on CPU, 8 requests x 4 beams: pdserve.bench.shared_prefix_bench,
# BENCHMARKS.md, issue 16).
MIN_SHARED_BLOCKS = 4
SHARED_TO_OWN_BLOCKS = 2


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
    in_place: bool = False,
) -> AttentionContext:
    """`in_place`: single-token sequences are read in place by the decode kernel
    (models/attention.read_in_place), which reads each one's own blocks: they need no length
    groups or shared-prefix families, only their context lengths."""
    num_blocks = [-(-(s + n) // block_size) for s, n in zip(starts, lens, strict=True)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    if in_place and max(lens) == 1:
        # Every sequence read in place: its block table and context length are all it needs.
        seqs = range(len(lens))
        return AttentionContext(
            slot_mapping=slot_mapping,
            block_tables=_padded_tables(seqs, tables, num_blocks).to(device),
            attn_mask=None,
            query_index=None,
            unpad_index=None,
            context_lens=_context_lens(seqs, starts, device),
        )
    firsts = [0] * len(lens)
    for i in range(1, len(lens)):
        firsts[i] = firsts[i - 1] + lens[i - 1]
    every = _padded(range(len(lens)), starts, lens, firsts, tables, num_blocks, block_size)
    query_index = unpad_index = None
    if max(lens) > 1:
        query_index = every.query_index.to(device)
        unpad_index = torch.nonzero(every.valid).squeeze(1).to(device)
    return AttentionContext(
        slot_mapping=slot_mapping,
        block_tables=every.block_tables.to(device),
        attn_mask=every.attn_mask.to(device),
        query_index=query_index,
        unpad_index=unpad_index,
        groups=_groups(starts, lens, firsts, tables, num_blocks, block_size, device, in_place),
    )


def _context_lens(seqs, starts, device) -> torch.Tensor:
    """Keys each single-token sequence attends over: its position, plus itself."""
    return torch.tensor([starts[i] + 1 for i in seqs], dtype=torch.int64, device=device)


def _groups(starts, lens, firsts, tables, num_blocks, block_size, device, in_place):
    """Families of single-token sequences sharing a prefix as pseudo-sequences, the other
    single-token sequences by length (attention.length_groups), multi-token ones together;
    None when that makes one group of plain sequences. `in_place`: the single-token sequences
    are one group, read in place."""
    single = [i for i, n in enumerate(lens) if n == 1]
    multi = [i for i, n in enumerate(lens) if n > 1]
    groups = []
    if in_place:
        families, members = [], []
        if single:  # read in place: block tables and context lengths, no mask or query index
            groups.append(
                AttentionGroup(
                    query_index=None,
                    out_rows=torch.tensor([firsts[i] for i in single], device=device),
                    valid_index=None,
                    block_tables=_padded_tables(single, tables, num_blocks).to(device),
                    attn_mask=None,
                    context_lens=_context_lens(single, starts, device),
                )
            )
    else:
        families = shared_prefix_families(single, tables, num_blocks)
        in_family = {i for members, _ in families for i in members}
        alone = [i for i in single if i not in in_family]
        members = [[alone[j] for j in g] for g in length_groups([num_blocks[i] for i in alone])]
    if multi:
        members.append(multi)
    if len(groups) + len(members) == 1 and not families:
        return None
    padded = [
        _padded(seqs, starts, lens, firsts, tables, num_blocks, block_size) for seqs in members
    ]
    if families:
        # Pseudo-sequences of similar width together, as plain ones are.
        widths = [shared + sum(num_blocks[i] - shared for i in fam) for fam, shared in families]
        for g in length_groups(widths):
            picked = [families[j] for j in g]
            padded.append(_shared_prefix(picked, starts, firsts, tables, num_blocks, block_size))
    return groups + [
        AttentionGroup(
            query_index=p.query_index.to(device),
            out_rows=p.query_index.flatten()[p.valid].to(device),
            valid_index=None if p.valid.all() else torch.nonzero(p.valid).squeeze(1).to(device),
            block_tables=p.block_tables.to(device),
            attn_mask=p.attn_mask.to(device),
        )
        for p in padded
    ]


def shared_prefix_families(
    seqs: list[int], tables: list[list[int]], num_blocks: list[int]
) -> list[tuple[list[int], int]]:
    """(members, shared blocks) of each family worth attending as one: two or more of `seqs`
    whose tables (the blocks they attend over) start with the same block ids, MIN_SHARED_BLOCKS
    or more of them and SHARED_TO_OWN_BLOCKS times any member's own blocks. Members are kept in
    `seqs` order; a family shares the blocks common to all its members."""
    by_first: dict[int, list[int]] = {}
    for i in seqs:
        by_first.setdefault(tables[i][0], []).append(i)
    families = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        shared = len(commonprefix([tables[i][: num_blocks[i]] for i in members]))
        own = max(num_blocks[i] for i in members) - shared
        if shared >= MIN_SHARED_BLOCKS and shared >= SHARED_TO_OWN_BLOCKS * own:
            families.append((members, shared))
    return families


def _shared_prefix(families, starts, firsts, tables, num_blocks, block_size) -> _Padded:
    """One pseudo-sequence per family, padded to the longest family and widest table. Query q
    of a family is member q's token at position starts[member]; pseudo block j holds positions
    block_pos[j] * block_size.. of its owner (-1: the shared blocks, every member's)."""
    num_q = max(len(members) for members, _ in families)
    pseudo_tables, block_pos, owner, query_index, q_pos, q_owner, valid = [], [], [], [], [], [], []
    for members, shared in families:
        table, pos, own = list(tables[members[0]][:shared]), list(range(shared)), [-1] * shared
        for q, i in enumerate(members):
            table += tables[i][shared : num_blocks[i]]
            pos += range(shared, num_blocks[i])
            own += [q] * (num_blocks[i] - shared)
        pseudo_tables.append(table)
        block_pos.append(pos)
        owner.append(own)
        # Padding rows repeat the last member; their outputs are dropped.
        rows = members + [members[-1]] * (num_q - len(members))
        query_index.append([firsts[i] for i in rows])
        q_pos.append([starts[i] for i in rows])
        q_owner.append([min(q, len(members) - 1) for q in range(num_q)])
        valid += [q < len(members) for q in range(num_q)]
    width = max(len(t) for t in pseudo_tables)
    far = 1 << 40  # a padding block's position: after every query, so masked
    for table, pos, own in zip(pseudo_tables, block_pos, owner, strict=True):
        pad = width - len(table)
        table += [0] * pad
        pos += [far] * pad
        own += [-2] * pad
    offsets = torch.arange(block_size)
    key_pos = (torch.tensor(block_pos)[:, :, None] * block_size + offsets).flatten(1)  # [F, S]
    key_owner = torch.tensor(owner).repeat_interleave(block_size, dim=1)[:, None, :]  # [F, 1, S]
    q_owner_t = torch.tensor(q_owner)[:, :, None]  # [F, Q, 1]
    mine = (key_owner == -1) | (key_owner == q_owner_t)
    mask = (key_pos[:, None, :] <= torch.tensor(q_pos)[:, :, None]) & mine  # [F, Q, S]
    return _Padded(
        torch.tensor(query_index, dtype=torch.int64),
        torch.tensor(valid),
        torch.tensor(pseudo_tables, dtype=torch.int64),
        mask.unsqueeze(1),
    )


def _padded(seqs, starts, lens, firsts, tables, num_blocks, block_size) -> _Padded:
    seqs = list(seqs)
    num_q = max(lens[i] for i in seqs)
    width = max(num_blocks[i] for i in seqs)
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
    return _Padded(query_index, valid, _padded_tables(seqs, tables, num_blocks), mask)


def _padded_tables(seqs, tables, num_blocks) -> torch.Tensor:
    """[len(seqs), widest] int64: each sequence's blocks it attends over, padded with block 0."""
    return padded_rows([tables[i] for i in seqs], max(num_blocks[i] for i in seqs))
