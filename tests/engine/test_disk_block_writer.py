"""The disk tier's writes on their own thread (disk_block_writer.py), with the writer held on a
real kernel wait: its next file is a FIFO that nobody reads until the test does, so writes stay
queued for as long as a case needs. Queued blocks are read back byte-identical from the queue;
the prefix index hears of a disk block only once its file is in place; a full queue drops the
block (a recompute, counted) instead of waiting; closing with writes queued discards them and
leaves no temporary file."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.engine.disk_block_writer import BlockFileWriter
from pdserve.engine.host_tier import host_tier_stats
from tests.engine.test_disk_tier import (
    A_TOKENS,
    disk_tiered,
    moved,
    pushed_to_disk,
    settled,
)
from tests.engine.test_host_tier import BS, seq

STALL = 0x5EED  # the hash of the block the writer is held on, not one of the tier's


@contextmanager
def writer_held(writer: BlockFileWriter) -> Iterator[None]:
    """Queues a write whose temporary file is a FIFO: the writer thread blocks opening it until
    this reads it on exit; the writes queued meanwhile wait behind it."""
    fifo = writer.dir / f"{STALL:016x}.tmp"
    os.mkfifo(fifo)
    writer.write(STALL, torch.zeros(4))
    deadline = time.monotonic() + 10
    while not writer.writing:  # taken by the thread: nothing can discard it now
        assert time.monotonic() < deadline
        time.sleep(0.001)
    try:
        yield
    finally:
        with open(fifo, "rb") as f:
            f.read()


def disk_files(writer: BlockFileWriter) -> list[str]:
    """The names in the run directory but the lock and the held write's."""
    return sorted(p.name for p in writer.dir.iterdir() if p.name != "lock" and "5eed" not in p.name)


def test_queued_blocks_are_read_from_the_queue_and_announced_only_once_written(tmp_path):
    bm, kv = disk_tiered(tmp_path, num_blocks=4, host_blocks=3, disk_blocks=8)
    disk = bm.host_tier.disk
    a_hashes = prompt_block_hashes(A_TOKENS, BS)
    with writer_held(disk.files):
        a, before = pushed_to_disk(bm, kv)
        assert all(h in disk.index for h in a_hashes)  # on the disk tier, queued
        events = bm.take_events()
        assert not moved(events, "stored", "disk")  # no file yet: the index still says host
        assert not moved(events, "removed", "host") and disk_files(disk.files) == []

        again = seq(A_TOKENS, 9)  # read while queued: from the queued bytes, not waited for
        assert bm.acquire_prefix(again, 12) == 12
        assert again.num_disk_hit_tokens == 12
        after = kv[:, :, again.block_table]
        assert torch.equal(after.view(torch.int32), before.view(torch.int32))  # byte for byte
        assert disk.read_bytes_per_s == 0  # the queue is not timed as the disk
        bm.release(again)
    settled(bm)
    events = bm.take_events()
    written = moved(events, "stored", "disk")
    assert written and not set(written) & set(a_hashes)  # a's writes were cancelled
    assert disk_files(disk.files) == sorted(f"{h:016x}.kv" for h in written)
    assert disk.num_written == len(written) == len(disk)
    bm.check_invariants()
    bm.host_tier.check_invariants()


def test_a_full_queue_drops_the_block_instead_of_waiting(tmp_path):
    bm, kv = disk_tiered(tmp_path, num_blocks=4, host_blocks=3, disk_blocks=8, queued_blocks=2)
    disk = bm.host_tier.disk
    with writer_held(disk.files):  # one place taken by the held write, one left
        pushed_to_disk(bm, kv)
        events = bm.take_events()
        assert disk.num_dropped >= 1 and len(disk) == 1
        assert len(moved(events, "removed", "host")) >= disk.num_dropped
    settled(bm)
    assert len(moved(bm.take_events(), "stored", "disk")) == 1
    assert len(disk_files(disk.files)) == 1
    assert host_tier_stats(bm.host_tier)["disk_dropped_blocks"] == disk.num_dropped
    again = seq(A_TOKENS, 9)
    assert bm.acquire_prefix(again, 12) < 12  # what was dropped is recomputed
    bm.check_invariants()
    bm.host_tier.check_invariants()


def test_closing_with_writes_queued_discards_them_and_leaves_no_temporary_file(tmp_path):
    bm, kv = disk_tiered(tmp_path, num_blocks=4, host_blocks=3, disk_blocks=8)
    disk = bm.host_tier.disk
    writer = disk.files
    with writer_held(writer):
        pushed_to_disk(bm, kv)
        queued = len(disk)
        assert queued >= 3
        closing = threading.Thread(target=bm.host_tier.close)
        closing.start()
        deadline = time.monotonic() + 10
        while not writer.num_discarded and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closing.is_alive()  # it waits for the write in flight
    closing.join(timeout=10)
    assert not closing.is_alive()
    assert writer.num_discarded == queued + 1  # the held write's too
    assert sorted(p.name for p in writer.dir.iterdir()) == ["lock"]
    assert not moved(bm.take_events(), "stored", "disk")
