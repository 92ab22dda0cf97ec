"""NIXL agents and the descriptors of the nixl transport (the `nixl` extra: `nixl-cu12`).

One agent per worker process side, over NIXL's UCX backend. `UCX_TLS` picks UCX's transports
and is read when the agent's backend starts, so `KVTransferConfig.nixl_ucx_tls` is put into the
environment just before: `tcp` across hosts, `shm` (plus `tcp` for the connection) on one host,
`rc` / `cuda_ipc` on InfiniBand / GPUs; unset, UCX picks what the hosts offer.

A transfer moves every layer of n blocks. In a KV cache `[L, 2, num_blocks, block_size, heads,
head_dim]` one (layer, K|V, block) region is contiguous, so the n reserved blocks are 2 L n
regions of the cache, and their source — the prefill side's gathered `[L, 2, n, ...]` tensor —
the same number of consecutive regions (NIXL merges adjacent ones).
"""

from __future__ import annotations

import importlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")  # the meta package, then the CUDA variants


def nixl_module() -> Any:
    """The NIXL Python API (`nixl_agent`, `nixl_agent_config`, `nixl_thread_sync_t`)."""
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise ImportError("the nixl KV transport needs NIXL: pip install 'pdserve[nixl]' (nixl-cu12)")


_ENV_LOCK = threading.Lock()


def make_agent(role: str, ucx_tls: str | None) -> Any:
    """A NIXL agent with the UCX backend, named uniquely (`pdserve-<role>-<random>`); safe to
    call from several threads at once (the agent serializes its own calls)."""
    nixl = nixl_module()
    # No progress thread: NIXL's spins without pause, and two of them (a prefill and a decode
    # worker) take every core of a small host. The side waiting on a transfer drives progress
    # itself instead (`drive`).
    config = nixl.nixl_agent_config(
        enable_prog_thread=False,
        backends=["UCX"],
        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    with _ENV_LOCK:  # UCX reads UCX_TLS while the backend starts
        if ucx_tls:
            os.environ["UCX_TLS"] = ucx_tls
        agent = nixl.nixl_agent(f"pdserve-{role}-{secrets.token_hex(6)}", config)
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend here: the nixl transport cannot run")
    return agent


def drive(agent: Any, done: Callable[[], bool], stop: Callable[[], bool]) -> None:
    """Progresses `agent` until `done()` or `stop()`. Over TCP each round moves about one
    socket buffer, so the pause between rounds stays short (10-50 us): one core is busy while a
    transfer is in flight, none otherwise."""
    pause = 0.00001
    while not done() and not stop():
        agent.get_new_notifs()  # one round of UCX progress
        time.sleep(pause)
        pause = min(pause * 2, 0.00005)


def memory_type(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor: ("DRAM", 0) or ("VRAM", cuda index)."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


def block_regions(
    base: int, device_id: int, planes: int, plane_blocks: int, blocks: np.ndarray, block_bytes: int
) -> np.ndarray:
    """Nx3 (address, length, device) rows of `blocks` in each of `planes` consecutive
    (layer, K|V) planes of `plane_blocks` blocks, plane-major: the C order of `[planes, n]`."""
    plane = np.arange(planes, dtype=np.uint64)[:, None] * np.uint64(plane_blocks)
    offsets = (plane + blocks.astype(np.uint64)[None, :]).reshape(-1) * np.uint64(block_bytes)
    rows = np.empty((offsets.size, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + offsets
    rows[:, 1] = block_bytes
    rows[:, 2] = device_id
    return rows
