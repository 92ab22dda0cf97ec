"""2-rank torch.distributed process groups, one per prefill-decode pair (collective transport).

Topology: one group per pair, formed lazily on the pair's first transfer and dropped on the
first error; the decode worker is rank 0 and hosts the pair's rendezvous (an in-process store,
one per decode worker, reached only through its KV endpoint: kv_transfer/rendezvous.py). Why
not one world group:
- Membership changes are local. Adding or removing a worker (autoscaling, a Ray actor restart
  with a new epoch) touches only the pairs it is in; a world group would have to be torn down and
  re-formed by every rank at once, and one dead rank poisons an NCCL communicator for all.
- Failure is local. A peer that dies mid-transfer breaks its pair's group only; the pair is
  re-formed on the next transfer while every other pair keeps streaming.
- Cost: start-up is one rendezvous per pair actually used (Gloo: ~ms over loopback plus a TCP
  connection; NCCL: a communicator init, ~0.1-1 s, paid on the first transfer of the pair),
  and memory per pair (NCCL: its p2p buffers, NCCL_BUFFSIZE x channels, a few to tens of MiB of
  GPU memory per peer; Gloo: socket buffers). With P prefill and D decode workers that is at
  most P x D groups, but only for pairs the router actually uses; a world group would pay one
  init of all P + D ranks on every membership change and the same per-peer p2p buffers.
Rendezvous through Ray: the decode worker's KV endpoint travels in its Ray reply to the router
and on to the prefill worker; `Connect` over that endpoint returns the pair id, and the store
operations of the group's formation go over that endpoint too (`Rendezvous`).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


def backend_for(device: str) -> str:
    """NCCL for a CUDA KV cache, Gloo for a CPU one."""
    return "nccl" if device.startswith("cuda") else "gloo"


def local_ip_towards(host: str) -> str:
    """This machine's address on the route to `host` (what the peer can reach us at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:  # connect() on UDP sends nothing; it only picks the interface
            probe.connect((host, 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def form_group(store: Any, rank: int, backend: str, my_host: str, timeout_s: float) -> Any:
    """Blocks until both ranks of the pair joined; returns the 2-rank process group. `store`
    holds only this pair's keys; Gloo listens on `my_host` only."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=my_host)]
        return dist.ProcessGroupGloo(store, rank, 2, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"unknown torch.distributed backend {backend!r}")


@dataclass
class PairGroup:
    """One side of a pair's process group. `lock` keeps each chunk's announce and send
    adjacent, so receives are posted in the order sends are issued (NCCL matches by order)."""

    pair_id: str
    rank: int
    backend: str
    group: Any = None
    ready: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    _next_tag: int = 0

    def next_tag(self) -> int:
        self._next_tag += 1
        return self._next_tag

    def close(self) -> None:
        """Best effort: a broken group (dead peer) must not block the caller."""
        group, self.group = self.group, None
        if group is not None:
            try:
                group.abort()
            except Exception:  # already broken; nothing more to release
                log.debug("aborting process group of pair %s failed", self.pair_id, exc_info=True)
