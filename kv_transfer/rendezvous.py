"""The rendezvous store of the collective transport, reachable only through the KV endpoint.

torch.distributed forms a process group by exchanging addresses through a key-value Store.
A TCPStore would listen on every interface of the decode worker, without authentication, and
answer `list_keys` with every pair id to anyone who connects. Instead the decode worker keeps
an in-process `HashStore`, and the prefill side reaches it with `RemoteStore`: a Store whose
operations are `Rendezvous` calls on the secret-checked (and, with TLS, encrypted) gRPC control
channel, each scoped by the decode worker to the keys of one pair id that `Connect` issued.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import grpc
import torch.distributed as dist

from kv_transfer.grpc_common import rpc_error_text
from pdserve.pb import kv_transfer_pb2 as pb

Op = pb.RendezvousRequest.Op


def pair_store(store: Any, pair_id: str) -> Any:
    """The keys of one pair inside the decode worker's store."""
    return dist.PrefixStore(f"pdserve-kv/{pair_id}/", store)


def serve_rendezvous(store: Any, request: pb.RendezvousRequest, max_wait_s: float) -> Any:
    """Runs one operation on `store` (already scoped to the request's pair). Waits are capped
    by `max_wait_s`; a key that does not appear in time raises (a store timeout)."""
    wait = datetime.timedelta(seconds=min(max(request.timeout_s, 0.001), max_wait_s))
    if request.op == Op.SET:
        store.set(request.key, request.value)
        return pb.RendezvousResponse()
    if request.op == Op.GET:
        store.wait([request.key], wait)
        return pb.RendezvousResponse(value=store.get(request.key))
    if request.op == Op.ADD:
        return pb.RendezvousResponse(count=store.add(request.key, request.amount))
    if request.op == Op.WAIT:
        store.wait(list(request.keys), wait)
        return pb.RendezvousResponse()
    if request.op == Op.CHECK:
        return pb.RendezvousResponse(present=store.check(list(request.keys)))
    raise ValueError(f"op {request.op} is not a rendezvous operation")


class RemoteStore(dist.Store):
    """The prefill side's view of one pair's keys in a decode worker's store."""

    def __init__(
        self, call: grpc.UnaryUnaryMultiCallable, endpoint: str, pair_id: str, metadata, timeout_s
    ) -> None:
        super().__init__()
        self._call, self._endpoint, self._pair_id = call, endpoint, pair_id
        self._metadata, self._timeout_s = metadata, timeout_s

    def _run(self, timeout_s: float | None = None, **fields: Any) -> pb.RendezvousResponse:
        wait_s = self._timeout_s if timeout_s is None else timeout_s
        request = pb.RendezvousRequest(pair_id=self._pair_id, timeout_s=wait_s, **fields)
        try:
            return self._call(request, timeout=wait_s + 5.0, metadata=self._metadata)
        except grpc.RpcError as exc:  # torch.distributed reports store failures as these
            raise RuntimeError(rpc_error_text(self._endpoint, exc)) from None

    def set(self, key: str, value: bytes | str) -> None:
        self._run(op=Op.SET, key=key, value=value.encode() if isinstance(value, str) else value)

    def get(self, key: str) -> bytes:
        return self._run(op=Op.GET, key=key).value

    def add(self, key: str, amount: int) -> int:
        return self._run(op=Op.ADD, key=key, amount=amount).count

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = None if timeout is None else timeout.total_seconds()
        self._run(seconds, op=Op.WAIT, keys=list(keys))

    def check(self, keys: Sequence[str]) -> bool:
        return self._run(op=Op.CHECK, keys=list(keys)).present
