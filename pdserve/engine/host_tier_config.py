"""The host tier an engine's config asks for (--kv-offload-gb, with the disk tier of
--kv-disk-dir under it), made for its executor: the torch engine's pools (host_kv_pool.py),
a tensor-parallel leader's, whose every rank copies its heads (tp_executor.py), or a sim
engine's modelled ones (sim_host_tier.py). Each is imported on use: only the torch ones
import torch."""

from __future__ import annotations

from typing import Any

from pdserve.engine.host_tier import HostTier
from pdserve.engine_config import EngineConfig


def host_tier_from_config(config: EngineConfig, executor: Any) -> HostTier | None:
    """None when off, without prefix caching, or too small for one block; ValueError naming
    the flag a combination does not support."""
    if not config.kv_offload_gb or not config.enable_prefix_caching:
        return None
    if config.kind == "sim":
        from pdserve.engine.sim_host_tier import make_sim_host_tier

        return make_sim_host_tier(executor, config)
    if config.kind != "torch":
        raise ValueError("kv_offload_gb: needs the torch engine")
    if config.tp > 1:  # every rank copies its heads (tp_executor.py); no disk tier yet
        if config.kv_disk_gb:
            raise ValueError("kv_disk_gb: not supported yet under tensor parallelism")
        return executor.host_tier(int(config.kv_offload_gb * 2**30))
    from pdserve.engine.host_kv_pool import make_host_tier

    return make_host_tier(
        executor.kv_cache,
        int(config.kv_offload_gb * 2**30),
        config.kv_disk_dir,
        int(config.kv_disk_gb * 2**30),
    )
