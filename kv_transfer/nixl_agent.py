"""NIXL agents and the descriptors of the nixl transport (the `nixl` extra: `nixl-cu12`).

One agent per worker process side, over NIXL's UCX backend. `UCX_TLS` picks UCX's transports
and is read when the agent's backend starts, so `KVTransferConfig.nixl_ucx_tls` is put into the
environment just before: `tcp` across hosts, `shm` (plus `tcp` for the connection) on one host,
`rc` / `cuda_ipc` on InfiniBand / GPUs; unset, UCX picks what the hosts offer.

UCX's tcp transport has no GET: a READ over it is emulated, the source answering with active
messages of `UCX_TCP_TX_SEG_SIZE` bytes (8 KiB by default), each a copy and a `send` of its own.
`UCX_TUNING` raises that to 1 MiB, which halves the CPU a READ costs (docs/kv_transfer.md);
a variable already in the environment wins. The receive segment must hold a whole message, so
every agent of a deployment needs the same values.

A transfer moves every layer of n blocks between two caches `[L, 2, num_blocks, block_size,
heads, head_dim]`, each registered once with its worker's agent. One (layer, K|V) plane's
consecutive blocks are contiguous, so a run of blocks consecutive on both sides is one
descriptor per plane: 2 L runs descriptors instead of 2 L n (`block_runs`, `run_regions`).

Between tensor-parallel workers of different degrees one side holds more heads than the part
moved (kv_transfer/head_slices.py): a head subset of a block `[block_size, heads, head_dim]` is
one contiguous piece per position, strided by the position's bytes, and a READ's local and
remote descriptors pair up one to one, so such a part takes one descriptor per (plane, block,
position): 2 L n block_size (`position_regions`).
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np
import psutil

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
# UCX defaults the nixl transport sets where the environment does not (see the module docstring)
UCX_TUNING = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}


def make_agent(role: str, ucx_tls: str | None, bind_host: str | None = None) -> Any:
    """A NIXL agent with the UCX backend, named uniquely (`pdserve-<role>-<random>`); safe to
    call from several threads at once (the agent serializes its own calls). With a specific
    `bind_host`, UCX listens only on the network interface of that address (`ucx_devices`)."""
    nixl = nixl_module()
    # No progress thread: NIXL's spins without pause, and two of them (a prefill and a decode
    # worker) take every core of a small host. The side waiting on a transfer drives progress
    # itself instead (`drive`).
    config = nixl.nixl_agent_config(
        enable_prog_thread=False,
        backends=["UCX"],
        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    with _ENV_LOCK:  # UCX reads its variables while the backend starts
        if ucx_tls:
            os.environ["UCX_TLS"] = ucx_tls
        if not any(name in os.environ for name in UCX_TUNING):  # both or neither: RX >= TX
            os.environ.update(UCX_TUNING)
        devices = None if "UCX_NET_DEVICES" in os.environ else ucx_devices(bind_host)
        if devices:  # this agent's only: the next one may bind elsewhere
            os.environ["UCX_NET_DEVICES"] = devices
        try:
            agent = nixl.nixl_agent(f"pdserve-{role}-{secrets.token_hex(6)}", config)
        finally:
            if devices:
                del os.environ["UCX_NET_DEVICES"]
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend here: the nixl transport cannot run")
    return agent


def ucx_devices(bind_host: str | None) -> str | None:
    """`UCX_NET_DEVICES` for an agent that must listen only on `bind_host`: the interface that
    holds the address (127.0.0.1: `lo`). UCX has no authentication, and unrestricted it
    listens on every interface. None for no host, a wildcard, or an address of no interface."""
    if bind_host in (None, "", "0.0.0.0", "::"):
        return None
    try:
        wanted = ipaddress.ip_address(bind_host)
    except ValueError:  # a name: UCX keeps its default
        return None
    for interface, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6) or not address.netmask:
                continue
            ip = address.address.split("%", 1)[0]
            network = ipaddress.ip_network(f"{ip}/{address.netmask}", strict=False)
            if wanted.version == network.version and wanted in network:
                return interface
    return None


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


def block_runs(dest: list[int], src: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dest starts, src starts, lengths) of the maximal runs of positions where both block id
    lists go up by one: `dest[i:i+k]` and `src[i:i+k]` are then each one contiguous range."""
    d, s = np.asarray(dest, dtype=np.int64), np.asarray(src, dtype=np.int64)
    if d.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [d.size])))
    return d[starts], s[starts], lengths


def run_regions(
    base: int,
    device_id: int,
    plane_blocks: int,
    planes: range,
    starts: np.ndarray,
    lengths: np.ndarray,
    block_bytes: int,
) -> np.ndarray:
    """Nx3 (address, length, device) rows of the block runs (`starts`, `lengths`) in each of
    `planes` of a cache at `base` whose (layer, K|V) planes hold `plane_blocks` blocks;
    plane-major, runs in the given order: the bytes of `cache[planes][:, blocks]` in C order."""
    plane = np.arange(planes.start, planes.stop, dtype=np.uint64)[:, None]
    first = plane * np.uint64(plane_blocks) + starts.astype(np.uint64)[None, :]
    rows = np.empty((first.size, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + first.reshape(-1) * np.uint64(block_bytes)
    rows[:, 1] = np.tile(lengths.astype(np.uint64), len(planes)) * np.uint64(block_bytes)
    rows[:, 2] = device_id
    return rows


def position_regions(
    base: int,
    device_id: int,
    plane_blocks: int,
    planes: range,
    blocks: np.ndarray,
    block_size: int,
    position_bytes: int,
    heads: tuple[int, int],
    head_bytes: int,
) -> np.ndarray:
    """Nx3 (address, length, device) rows, one per (plane, block, position), of heads
    [h0, h1) (the cache's own indices) of `blocks` in each of `planes` of a cache at `base`:
    the bytes of `cache[planes][:, blocks, :, h0:h1]` in C order. `position_bytes` is one
    position's bytes (every head), `head_bytes` one head's."""
    plane = np.arange(planes.start, planes.stop, dtype=np.uint64)[:, None, None]
    block = blocks.astype(np.uint64)[None, :, None]
    position = np.arange(block_size, dtype=np.uint64)[None, None, :]
    first = (plane * np.uint64(plane_blocks) + block) * np.uint64(block_size) + position
    rows = np.empty((first.size, 3), dtype=np.uint64)
    offset = np.uint64(base + heads[0] * head_bytes)
    rows[:, 0] = offset + first.reshape(-1) * np.uint64(position_bytes)
    rows[:, 1] = (heads[1] - heads[0]) * head_bytes
    rows[:, 2] = device_id
    return rows


def regions_checksum(cache: torch.Tensor, rows: np.ndarray, value: int = 0) -> int:
    """Checksum of the regions `rows` of `cache`, in order, continuing from `value`: CRC-32C on
    CPU (each region read in place, no copy); on CUDA `wire.checksum` of the gathered regions
    (a position-weighted sum that does not continue: `value` must be 0 there)."""
    from kv_transfer import wire

    if cache.device.type != "cpu":
        import torch

        flat = cache.reshape(-1).view(torch.uint8)
        offsets = (rows[:, 0] - np.uint64(cache.data_ptr())).astype(np.int64).tolist()
        lengths = rows[:, 1].astype(np.int64).tolist()
        pieces = [flat[o : o + n] for o, n in zip(offsets, lengths, strict=True)]
        return wire.checksum(torch.cat(pieces))
    cache_bytes = wire.tensor_bytes(cache)
    base = cache.data_ptr()
    for address, length, _ in rows.tolist():
        offset = address - base
        value = crc32c.crc32c(cache_bytes[offset : offset + length], value)
    return value
