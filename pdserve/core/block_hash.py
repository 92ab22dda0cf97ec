"""THE chained block hash: the engine, the router and the prefix index all use this one.

A full KV block is named by hash(parent block's hash, the block's token ids). Chaining makes a
block's name depend on the whole prefix before it, so equal names mean equal prefixes. The hash
is blake2b over a fixed byte encoding: identical across processes, runs and machines (Python's
built-in `hash()` is salted per process and must never be used here).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The parent hash of a sequence's first block. Part of the wire contract with the index.
ROOT_HASH = 0
_MASK = (1 << 63) - 1  # keep hashes positive and inside a signed 64-bit integer (Redis, protobuf)
_PARENT = struct.Struct("<q")


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (ROOT_HASH for the first block)."""
    return _digest(_PARENT.pack(parent_hash) + struct.pack(f"<{len(token_ids)}I", *token_ids))


# An empty 8-byte blake2b state: each block hashes on a copy of it, the same digest as
# blake2b(data, digest_size=8) at ~60% of the cost (the constructor's keyword parsing is most
# of a 72-byte hash).
_EMPTY_STATE = hashlib.blake2b(digest_size=8)


def _digest(
    parent_and_tokens: bytes, new_state=_EMPTY_STATE.copy, from_bytes=int.from_bytes
) -> int:
    """The hash of a block from its parent's hash (8 bytes, little-endian) and its tokens (4
    bytes each, little-endian), as one buffer: the same digest as the two in turn, fewer calls.
    The defaults bind the callees once: the router hashes 256 blocks per 4096-token prompt."""
    state = new_state()
    state.update(parent_and_tokens)
    return from_bytes(state.digest(), "little") & _MASK


# Blocks hashed lately, hash input (parent hash and packed tokens, one bytes object) -> hash,
# split by parent into MEMO_SHARDS shards of two generations each: a lookup that misses a
# shard's young generation and hits its old one moves the entry back, and a young generation,
# once it holds its share of MEMO_BLOCKS, becomes the old one. Prompts share prefixes (system
# prompts, each conversation's history), and a dict lookup on those bytes costs a fraction of
# a blake2b call, so the router hashes a 4096-token prompt whose blocks it has seen in ~80-95
# us instead of ~230 (~320 with blake2b's constructor per block, before `_EMPTY_STATE`). The
# key is the whole input of the hash, so a hit is the hash itself, never a guess; and it is
# bytes, which the garbage collector does not track (a tuple key would add 256 tracked objects
# per prompt). Shards, because a dict grows by rebuilding itself whole inside the call that
# adds the entry: ~1 ms at 32k entries, a 16th of that per shard. At most 2 * MEMO_BLOCKS
# entries of ~250 bytes (~16 MB) per process.
MEMO_BLOCKS = 1 << 15
MEMO_SHARDS = 16
_young: list[dict[bytes, int]] = [{} for _ in range(MEMO_SHARDS)]
_old: list[dict[bytes, int]] = [{} for _ in range(MEMO_SHARDS)]


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every *full* block of `token_ids`; a trailing partial block has none."""
    full = len(token_ids) // block_size * block_size
    # Every full block's tokens packed at once: the router hashes each prompt it routes. (Bytes
    # slices of a block are cheaper to take than memoryview ones.)
    packed = struct.pack(f"<{full}I", *token_ids[:full])
    step = 4 * block_size
    shard_blocks = MEMO_BLOCKS // MEMO_SHARDS
    pack_parent = _PARENT.pack
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(packed), step):
        data = pack_parent(parent) + packed[start : start + step]
        shard = parent % MEMO_SHARDS
        young = _young[shard]
        h = young.get(data)
        if h is None:
            h = _old[shard].get(data)
            if h is None:
                h = _digest(data)
            young[data] = h
            if len(young) >= shard_blocks:  # a new generation; racing threads only lose entries
                _old[shard], _young[shard] = young, {}
        parent = h
        hashes.append(h)
    return hashes


def forget_hashed_blocks() -> None:
    """Empties the memo of recently hashed blocks (benchmarks that time hashing from cold)."""
    for generation in (*_young, *_old):
        generation.clear()
