"""prompt_block_hashes (the router's batched path) names blocks exactly as block_hash does."""

from __future__ import annotations

import hashlib
import random
import shutil
import struct

import pytest

from pdserve.core.block_hash import ROOT_HASH, block_hash, prompt_block_hashes


def chained(token_ids: list[int], block_size: int) -> list[int]:
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def test_prompt_hashes_chain_block_hash_over_full_blocks_only() -> None:
    rng = random.Random(0)
    for length in (0, 1, 15, 16, 17, 100, 4096, 4100):
        for block_size in (1, 4, 16, 17):
            prompt = [rng.randrange(1 << 32) for _ in range(length)]
            assert prompt_block_hashes(prompt, block_size) == chained(prompt, block_size)
            assert prompt_block_hashes(tuple(prompt), block_size) == chained(prompt, block_size)
    assert len(prompt_block_hashes(list(range(40)), 16)) == 2  # the partial tail has no hash


def test_the_c_chain_hashes_as_blake2b_over_one_or_more_chunks(monkeypatch) -> None:
    """pdserve/core/_block_chain.c against hashlib, whatever the block's length: BLAKE2b
    compresses 128 bytes at a time, and a block of 30 tokens plus its parent is exactly 128."""
    native = pytest.importorskip("pdserve.core._block_chain")
    rng = random.Random(2)
    for block_size in (1, 4, 16, 29, 30, 31, 32, 61, 62, 64, 100):
        for length in (0, block_size - 1, block_size, 3 * block_size + 1):
            prompt = [rng.randrange(1 << 32) for _ in range(length)]
            packed = struct.pack(f"<{length}I", *prompt)
            for root in (ROOT_HASH, rng.getrandbits(63)):
                expected, parent = [], root
                for i in range(length // block_size):
                    data = (
                        struct.pack("<q", parent) + packed[4 * block_size * i :][: 4 * block_size]
                    )
                    digest = hashlib.blake2b(data, digest_size=8).digest()
                    parent = int.from_bytes(digest, "little") & ((1 << 63) - 1)
                    expected.append(parent)
                assert native.chain(packed, 4 * block_size, root) == expected
    with pytest.raises(ValueError, match="block_bytes"):
        native.chain(b"", 0, 0)
    # And prompt_block_hashes without it (an install with no C compiler) gives the same.
    from pdserve.core import block_hash as module

    prompt = [rng.randrange(1 << 32) for _ in range(300)]
    with_c = prompt_block_hashes(prompt, 16)
    monkeypatch.setattr(module, "_native_chain", None)
    assert prompt_block_hashes(prompt, 16) == with_c == chained(prompt, 16)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the Python hashes serve")
def test_the_c_chain_is_built_where_a_compiler_is() -> None:
    """`pip install -e .` builds it (optional in pyproject.toml, so a failed build would pass
    silently and the router would hash ~4x slower)."""
    from pdserve.core import block_hash

    assert block_hash._native_chain is not None
