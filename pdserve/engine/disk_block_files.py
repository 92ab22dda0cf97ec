"""DiskBlockFiles: the disk tier's bytes (disk_tier.py), one file per KV block.

A block is written under a temporary name and renamed into place, so a file under its final
name is whole. Its header carries the block hash, the payload's length and a CRC-32 of the
payload, all checked on every read: a torn, truncated, foreign or corrupted file is refused
(the caller recomputes the block), never served as KV.

Each run writes into a directory of its own under --kv-disk-dir and holds an exclusive lock on
it while it lives, so several workers may share one --kv-disk-dir. At start, every run
directory whose lock nobody holds (its process is gone) is deleted: the files of a previous run
are reclaimed, not re-indexed. That worker's entries left the prefix index when it died (the
sweeper), its blocks are only valid for the model, dtype and block size it ran with, and a crash
may have left temporary files; a new run starts cold, as its device pool does.

No fsync: it would only make files survive a power loss for a later run to re-index, and
runs delete what earlier ones left. Within a run the page cache serves a finished write, and a
file damaged behind our back fails its checks. Measured on this project's CPU machine (ext4,
8 KiB blocks): 5.65 ms a block written with fsync, 0.23 ms without. Writes run on the disk
tier's writer thread (disk_block_writer.py), reads on the engine's.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<8sqQI4x")  # magic, block hash, payload bytes, CRC-32 of the payload
_MAGIC = b"PDKVBLK1"
_RUN_PREFIX = "run-"
_LOCK_NAME = "lock"


class DiskBlockFiles:
    def __init__(self, base_dir: str | Path) -> None:
        base = Path(base_dir)
        base.mkdir(parents=True, exist_ok=True)
        self.num_reclaimed_runs = reclaim_dead_runs(base)
        # Locked before it gets the name other runs' reclaims look at, so it is never taken
        # for a dead run's.
        new = Path(tempfile.mkdtemp(prefix=".new-", dir=base))
        self._lock = open(new / _LOCK_NAME, "w")  # noqa: SIM115 (held for the process's life)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.dir = base / (_RUN_PREFIX + new.name.removeprefix(".new-"))
        new.rename(self.dir)
        self.write_failures = 0  # writes refused by the file system (full disk, I/O error)
        self.read_failures = 0  # files missing, unreadable or failing their checks

    @staticmethod
    def file_bytes(payload_bytes: int) -> int:
        """What one block of `payload_bytes` takes on disk (the budget counts it)."""
        return _HEADER.size + payload_bytes

    def write(self, block_hash: int, payload: torch.Tensor | bytes) -> bool:
        """Stores a block's bytes (a contiguous CPU tensor, or its bytes); False when the file
        system refused (nothing of it is left behind)."""
        data = payload if isinstance(payload, bytes) else tensor_bytes(payload)
        header = _HEADER.pack(_MAGIC, block_hash, len(data), zlib.crc32(data))
        final, temporary = self._path(block_hash), self._path(block_hash, ".tmp")
        try:
            with open(temporary, "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(temporary, final)
            return True
        except OSError as e:
            self.write_failures += 1
            if self.write_failures == 1:  # a full disk fails every write: say it once
                log.warning("KV disk tier: writing %s failed (%s); recomputing instead", final, e)
            temporary.unlink(missing_ok=True)
            return False

    def read(self, block_hash: int, out: torch.Tensor) -> bool:
        """Reads a block's bytes into `out` (a contiguous CPU tensor of the block's shape);
        False when the file is missing, unreadable or fails a check (`out` is then garbage)."""
        buffer = tensor_bytes(out)
        try:
            with open(self._path(block_hash), "rb") as f:
                header = f.read(_HEADER.size)
                size = os.fstat(f.fileno()).st_size
                got = f.readinto(buffer) if len(header) == _HEADER.size else 0
        except OSError:
            got, header, size = -1, b"", 0
        ok = (
            len(header) == _HEADER.size
            and size == _HEADER.size + len(buffer) == _HEADER.size + got
            and _HEADER.unpack(header) == (_MAGIC, block_hash, len(buffer), zlib.crc32(buffer))
        )
        if not ok:
            self.read_failures += 1
        return ok

    def delete(self, block_hash: int) -> None:
        try:
            self._path(block_hash).unlink(missing_ok=True)
        except OSError as e:  # the tier forgets it either way; the file is reclaimed at start
            log.warning("KV disk tier: deleting a block file failed: %s", e)

    def used_bytes(self) -> int:
        """The bytes of every file of this run (temporary ones too), as the disk counts them;
        a file renamed or deleted while they are counted (the writer thread) is skipped."""
        total = 0
        for path in self.dir.iterdir():
            if path.name != _LOCK_NAME:
                try:
                    total += path.stat().st_size
                except FileNotFoundError:
                    continue
        return total

    def _path(self, block_hash: int, suffix: str = ".kv") -> Path:
        return self.dir / f"{block_hash:016x}{suffix}"


def reclaim_dead_runs(base: Path) -> int:
    """Deletes the run directories under `base` whose process is gone (nobody holds their
    lock); returns how many."""
    reclaimed = 0
    for run in base.glob(_RUN_PREFIX + "*"):
        try:
            with open(run / _LOCK_NAME, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its run lives
                shutil.rmtree(run)
                reclaimed += 1
        except BlockingIOError:
            continue
        except OSError as e:
            log.warning("KV disk tier: reclaiming %s failed: %s", run, e)
    return reclaimed


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    assert tensor.is_contiguous() and not tensor.is_cuda
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
