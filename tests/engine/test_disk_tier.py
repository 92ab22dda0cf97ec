"""The disk tier (--kv-disk-dir, --kv-disk-gb) under the host tier: blocks the host evicts are
written to files and read back byte-identical; the files never exceed their budget (queued
writes counted) and the union of the three tiers stays prefix-closed; a corrupted file or a
write the file system refuses is a recompute; the files of a dead run are deleted at start, a
live run's kept. The writer thread's own cases are in test_disk_block_writer.py."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.core.block_hash import ROOT_HASH, prompt_block_hashes
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.disk_block_files import DiskBlockFiles
from pdserve.engine.host_kv_pool import make_host_tier
from pdserve.engine.sequence import Sequence
from tests.engine.test_host_tier import BS, block_bytes, compute, kv_pool, seq

A_TOKENS = list(range(13))  # 3 full blocks + 1 partial


def disk_tiered(
    disk_dir: Path, num_blocks: int, host_blocks: int, disk_blocks: int, queued_blocks: int = 64
) -> tuple[BlockManager, torch.Tensor]:
    kv = kv_pool(num_blocks)
    per_file = DiskBlockFiles.file_bytes(block_bytes(kv))
    tier = make_host_tier(
        kv,
        host_blocks * block_bytes(kv),
        str(disk_dir),
        disk_blocks * per_file + per_file - 1,
        queued_blocks * block_bytes(kv),
    )
    assert tier.disk is not None and tier.disk.index.num_slots == disk_blocks
    return BlockManager(num_blocks, BS, host_tier=tier), kv


def pushed_to_disk(bm: BlockManager, kv: torch.Tensor) -> tuple[Sequence, torch.Tensor]:
    """A's 3 full blocks computed, then two other prompts push them device -> host -> disk
    (4 device blocks, 3 host slots); returns A and its blocks' bytes as computed."""
    a = seq(A_TOKENS)
    assert compute(bm, kv, a, seed=1)
    before = kv[:, :, a.block_table[:3]].clone()
    bm.release(a)
    for i, first in enumerate((100, 200)):
        other = seq(list(range(first, first + 16)), i + 1)
        assert compute(bm, kv, other, seed=i + 2)
        bm.release(other)
    return a, before


def settled(bm: BlockManager) -> None:
    """Waits for the disk tier's queued writes to end (their events are then taken)."""
    assert bm.host_tier.disk.files.wait_idle()


def moved(events, kind: str, tier: str) -> list[int]:
    return [h for e in events if (e.kind, e.tier) == (kind, tier) for h in e.block_hashes]


def test_blocks_evicted_from_host_come_back_from_disk_byte_identical(tmp_path):
    bm, kv = disk_tiered(tmp_path, num_blocks=4, host_blocks=3, disk_blocks=8)
    a, before = pushed_to_disk(bm, kv)
    settled(bm)
    a_hashes = prompt_block_hashes(A_TOKENS, BS)
    events = bm.take_events()
    assert set(a_hashes) <= set(moved(events, "stored", "disk"))  # and one of the first other's
    assert not moved(events, "removed", "host") and not moved(events, "removed", "disk")
    disk = bm.host_tier.disk
    assert len(list(disk.files.dir.glob("*.kv"))) == len(disk) >= 3

    again = seq(A_TOKENS, 9)
    assert bm.acquire_prefix(again, 12) == 12
    assert again.num_disk_hit_tokens == 12 and again.num_host_hit_tokens == 0
    after = kv[:, :, again.block_table]
    assert torch.equal(after.view(torch.int32), before.view(torch.int32))  # byte for byte
    assert moved(bm.take_events(), "stored", "device")[-3:] == a_hashes
    assert disk.num_restored == 3 and disk.read_bytes_per_s > 0
    for h in a_hashes:  # read back: out of the disk tier, its file deleted
        assert h not in disk.index and not (disk.files.dir / f"{h:016x}.kv").exists()
    bm.check_invariants()
    bm.host_tier.check_invariants()


def test_a_corrupted_file_is_a_recompute_of_it_and_what_extends_it(tmp_path):
    bm, kv = disk_tiered(tmp_path, num_blocks=4, host_blocks=3, disk_blocks=8)
    pushed_to_disk(bm, kv)
    settled(bm)
    bm.take_events()
    a_hashes = prompt_block_hashes(A_TOKENS, BS)
    disk = bm.host_tier.disk
    path = disk.files.dir / f"{a_hashes[1]:016x}.kv"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit of the payload: only the checksum can tell
    path.write_bytes(bytes(data))

    again = seq(A_TOKENS, 9)
    assert bm.acquire_prefix(again, 12) == 4  # the first block is read; the rest is computed
    assert again.num_disk_hit_tokens == 4
    assert disk.files.read_failures == 1
    assert sorted(moved(bm.take_events(), "removed", "disk")) == sorted(a_hashes[1:])
    assert a_hashes[2] not in disk.index and not path.exists()
    bm.check_invariants()
    bm.host_tier.check_invariants()


def test_a_write_the_file_system_refuses_drops_the_block_and_leaves_nothing(tmp_path):
    """A real write error from the kernel (a file size limit, EFBIG, as a full disk's ENOSPC
    is one): the host's evicted blocks are dropped as without a disk tier."""
    bm, kv = disk_tiered(tmp_path, num_blocks=4, host_blocks=3, disk_blocks=8)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # below one block's file
    try:
        pushed_to_disk(bm, kv)
        settled(bm)  # the writer thread writes under the same limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    events = bm.take_events()
    disk = bm.host_tier.disk
    assert disk.files.write_failures >= 3 and len(disk) == 0
    assert set(prompt_block_hashes(A_TOKENS, BS)) <= set(moved(events, "removed", "host"))
    assert not moved(events, "stored", "disk")
    assert [p.name for p in disk.files.dir.iterdir()] == ["lock"]  # no temporary file left
    assert bm.acquire_prefix(seq(A_TOKENS, 9), 12) == 0  # a miss, not an error
    bm.check_invariants()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=30
    ),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(1, 4),
)
def test_disk_tier_never_exceeds_its_budget_and_stays_prefix_closed(
    tmp_path_factory, ops, host_blocks, disk_blocks, queued_blocks
):
    """Random conversations computed, held, released and brought back while the writer thread
    writes: the files (temporary ones too) never take more bytes than the budget, queued blocks
    counted in it, and every block held in any tier has its parent held. Checked at every
    step with writes still queued, and once they are all written."""
    disk_dir = tmp_path_factory.mktemp("disk")
    bm, kv = disk_tiered(disk_dir, 6, host_blocks, disk_blocks, queued_blocks)
    disk = bm.host_tier.disk
    budget = disk_blocks * DiskBlockFiles.file_bytes(block_bytes(kv))
    files = disk.files.files
    held: list[Sequence] = []
    for i, (family, blocks, keep) in enumerate(ops):
        tokens = [family] * (BS * 2) + [1000 + family * 7 + blocks] * (BS * blocks - BS)
        s = seq(tokens[: BS * blocks + 1], i)
        if compute(bm, kv, s, i) and keep:
            held.append(s)
        else:
            bm.release(s)
        if len(held) > 1:
            bm.release(held.pop(0))
        assert files.used_bytes() <= budget and len(disk) <= disk_blocks
        bm.take_events()
        if i % 3 == 2:
            settled(bm)
            bm.take_events()
            assert len(list(files.dir.glob("*.kv"))) == len(disk)
            assert files.used_bytes() == len(disk) * DiskBlockFiles.file_bytes(block_bytes(kv))
        bm.host_tier.check_invariants()
        bm.check_invariants()
        host = bm.host_tier.index
        for h, block in [*host.items(), *disk.index.items()]:
            parent = block.parent
            held_somewhere = bm.is_cached(parent) or parent in host or parent in disk.index
            assert parent == ROOT_HASH or held_somewhere, h
        for _, block in host.items():  # a host block's parent is never on the disk
            assert block.parent not in disk.index


_DEAD_RUN = """
import os, sys, torch
from pdserve.engine.disk_block_files import DiskBlockFiles
files = DiskBlockFiles(sys.argv[1])
assert files.write(7, torch.arange(8.0))
os._exit(0)  # no cleanup: as a worker that was killed
"""


def test_files_of_dead_runs_are_deleted_at_start_and_live_runs_kept(tmp_path):
    subprocess.run([sys.executable, "-c", _DEAD_RUN, str(tmp_path)], check=True)
    (dead,) = tmp_path.glob("run-*")
    assert (dead / f"{7:016x}.kv").exists()
    live = DiskBlockFiles(tmp_path)
    assert live.num_reclaimed_runs == 1 and not dead.exists()
    assert live.write(7, torch.arange(8.0))

    other = DiskBlockFiles(tmp_path)  # a second worker sharing the directory
    assert other.num_reclaimed_runs == 0 and live.dir.exists()
    out = torch.empty(8)
    assert live.read(7, out) and torch.equal(out, torch.arange(8.0))
    assert not other.read(7, out)  # each run reads its own files only
    assert sorted(tmp_path.iterdir()) == sorted([live.dir, other.dir])
