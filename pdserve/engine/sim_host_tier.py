"""The host tier (and the disk tier under it) of a sim engine: the engine's own HostTier and
DiskTier over byte movers that hold nothing and charge their modelled links to the engine's
steps (pdserve/sim/kv_tiers.py). Budgets count blocks of the simulated model's full size, as
the torch engine's count its pool's."""

from __future__ import annotations

from typing import Any

from pdserve.engine.disk_tier import DiskTier
from pdserve.engine.host_tier import HostTier
from pdserve.engine_config import EngineConfig
from pdserve.sim.kv_tiers import GB, SimBlockBytes, SimBlockCopier, SimBlockFiles, TierLink


def make_sim_host_tier(executor: Any, config: EngineConfig) -> HostTier | None:
    """The tiers of --kv-offload-gb and --kv-disk-gb on `executor` (a SimExecutor), None when
    not one block fits in the host budget; a disk budget with no room for a block is no disk."""
    per_block = executor.bytes_per_block
    slots = int(config.kv_offload_gb * 2**30) // per_block
    if not slots:
        return None
    sim = config.sim
    charges = executor.charge_tier_transfers()
    host_link = TierLink(sim.host_link_gbs * GB, sim.host_link_latency_us / 1e6)
    disk_link = TierLink(sim.disk_read_gbs * GB, sim.disk_read_latency_us / 1e6)
    disk_slots = int(config.kv_disk_gb * 2**30) // per_block
    disk = None
    if disk_slots:
        files = SimBlockFiles(disk_link, charges)
        disk = DiskTier(files, disk_slots, SimBlockBytes(per_block), clock=lambda: charges.total)
    return HostTier(SimBlockCopier(per_block, host_link, charges), slots, disk)
