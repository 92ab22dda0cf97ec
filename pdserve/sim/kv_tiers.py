"""The host and disk KV tiers of a simulated worker: capacity and transfer time, no bytes.

The engine's own `HostTier` and `DiskTier` (pdserve/engine/host_tier.py, disk_tier.py) run
unchanged on a sim engine, so the tiers keep the real ones' prefix-closed LRU policy and their
budgets; only their two byte movers are replaced here. `SimBlockCopier` (the host pool) and
`SimBlockFiles` (the block files) store nothing and charge what moving a block would take on
its modelled link to `TierCharges`; `TierChargedTiming` adds the charges to the step that
needs the blocks, after its compute (not overlapped: a restore in the real engine is fenced
before the step's forward, host_kv_pool.py). Offloads are not charged: the device-to-host
copy runs on a side stream while the GPU computes (PCIe is full duplex, so it does not slow
the copies back), and the disk writes of evicted host blocks leave the step's path as well.

Links (defaults, `--sim-host-link-gbs` and the flags after it): the host link is PCIe 5 x16,
64 GB/s per direction on paper, ~50 GB/s measured from pinned memory to an H100, plus ~10 us
per copy (one `copy_` per block, as HostKVPool issues them); the disk is one NVMe drive,
~6 GB/s sequential read (a PCIe 4 data-centre SSD; Gen5 drives read ~12 GB/s) plus ~100 us per
read, and its blocks then cross the host link as the real disk tier's do (file -> host staging
-> device).

Imports nothing of pdserve: these classes meet the engine's protocols by shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 10**9


@dataclass(frozen=True)
class TierLink:
    """A modelled link: bandwidth and a fixed cost per transfer."""

    bytes_per_s: float
    latency_s: float

    def seconds(self, num_bytes: int) -> float:
        """How long one transfer of `num_bytes` takes."""
        return self.latency_s + num_bytes / self.bytes_per_s


class TierCharges:
    """Modelled seconds of tier transfers owed by the next step, and all charged so far."""

    def __init__(self) -> None:
        self.pending = 0.0
        self.total = 0.0  # also the modelled clock DiskTier times its reads by

    def charge(self, seconds: float) -> None:
        self.pending += seconds
        self.total += seconds

    def take(self) -> float:
        """The seconds owed, now paid."""
        owed, self.pending = self.pending, 0.0
        return owed


@dataclass(frozen=True)
class SimBlockBytes:
    """One block's bytes in host memory, by count only (what DiskTier reads of a payload)."""

    nbytes: int

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1


class SimBlockCopier:
    """host_tier.BlockCopier without a pool: a copy back to the device is charged to the host
    link, a copy to the host is free (overlapped, see the module's docstring)."""

    def __init__(self, bytes_per_block: int, link: TierLink, charges: TierCharges) -> None:
        self.bytes_per_s = int(link.bytes_per_s)  # what the worker reports, the router prices
        self._block = SimBlockBytes(bytes_per_block)
        self._link = link
        self._charges = charges

    def save(self, block_id: int, slot: int) -> None:
        """Asynchronous on the device (a side stream): no time charged."""

    def load(self, slot: int, block_id: int) -> None:
        self._charges.charge(self._link.seconds(self._block.nbytes))

    def host_block(self, slot: int) -> SimBlockBytes:
        return self._block

    def load_from(self, data: Any, block_id: int) -> None:
        self._charges.charge(self._link.seconds(data.nbytes))

    def fence(self) -> None:
        """The charges already stand for the wait."""


class SimBlockFiles:
    """disk_tier.BlockFiles without files: every write lands at once (not charged: it leaves
    the step's path), every read lands and is charged to the disk link."""

    write_failures = 0
    read_failures = 0

    def __init__(self, link: TierLink, charges: TierCharges) -> None:
        self._link = link
        self._charges = charges
        self._written: list[tuple[int, bool]] = []

    def queue_full(self) -> bool:
        return False

    def write(self, block_hash: int, payload: Any) -> None:
        self._written.append((block_hash, True))

    def take_finished(self) -> list[tuple[int, bool]]:
        written, self._written = self._written, []
        return written

    def read(self, block_hash: int, out: Any) -> bool:
        self._charges.charge(self._link.seconds(out.nbytes))
        return True

    def delete(self, block_hash: int) -> None:
        """Nothing was written."""
        self._written = [w for w in self._written if w[0] != block_hash]

    def close(self) -> None:
        """Nothing runs in the background."""


class TierChargedTiming:
    """A step timing model plus the tier transfers the step waited for."""

    def __init__(self, timing: Any, charges: TierCharges) -> None:
        self.timing = timing
        self.charges = charges

    def step_seconds(self, work: Any) -> float:
        return self.timing.step_seconds(work) + self.charges.take()

    def min_sampling_step_seconds(self) -> float:
        return self.timing.min_sampling_step_seconds()
