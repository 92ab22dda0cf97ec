"""KV transfer from prefill to decode workers: one interface, three transports.

- `base.py` — the seam: KVSender / KVReceiver ABCs, the KVSink protocol, request dataclasses.
- `wire.py` — chunk framing without extra copies, checksums.
- `reservations.py` — decode-side table of transfers: deadlines, fencing, commit, the reaper.
- `grpc_common.py` — secret, channel options, auth interceptor, status codes.
- `grpc_receiver.py` / `grpc_sender.py` — the grpc transport (and the control plane of both).
- `collective_group.py` — 2-rank torch.distributed groups, one per prefill-decode pair.
- `collective_receiver.py` / `collective_sender.py` — the collective transport (NCCL / Gloo).
- `rendezvous.py` — the collective transport's rendezvous store, reached only through the
  secret-checked KV endpoint (no open TCPStore).
- `nixl_agent.py` — NIXL agents (UCX backend, `UCX_TLS` from the config, 1 MiB TCP
  segments), the merged block-run descriptors of the nixl transport and their checksum.
- `nixl_receiver.py` / `nixl_sender.py` — the nixl transport: the decode worker READs the
  missing blocks straight from the prefill worker's KV cache into the reserved blocks (NIXL
  over UCX).
- `head_slices.py` / `tp_handoff.py` — handoffs between tensor-parallel workers: which heads
  each prefill rank sends to which decode rank; rank 0's receiver that opens, seals and aborts
  every decode rank's part; every prefill rank's push and rank 0's commit.
- `tls.py` — TLS / mutual TLS credentials of the KV endpoint and of the senders' channels.
- `factory.py` — `make_receiver(config, sink, layout, kv_cache)`,
  `make_sender(config, kv_cache)`.

Group topology of the collective transport: one 2-rank process group per prefill-decode pair,
formed lazily on the pair's first transfer; see docs/kv_transfer.md for why and what it costs.
"""

from kv_transfer.base import (
    CommitInfo,
    KVLayout,
    KVReceiver,
    KVSender,
    KVSink,
    KVTransferError,
    TransferRequest,
    TransferResult,
)
from kv_transfer.factory import make_receiver, make_sender

__all__ = [
    "CommitInfo",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVSink",
    "KVTransferError",
    "TransferRequest",
    "TransferResult",
    "make_receiver",
    "make_sender",
]
