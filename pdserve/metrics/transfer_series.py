"""KV transfer series (`KV_TRANSFER_BYTES`, `KV_TRANSFER_FAILURES{reason}`,
`KV_TRANSFER_SECONDS`) and `transfer_failure_reason`. Both ends count a transfer: the router
the ones it saw succeed or fail, a worker its own side."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from pdserve.metrics.buckets import TRANSFER_BUCKETS

KV_TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes_total", "KV cache bytes sent from prefill to decode workers."
)
KV_TRANSFER_FAILURES = Counter(
    "pdserve_kv_transfer_failures_total",
    "Failed KV transfers by reason: timeout, checksum, rejected, connection, worker_died, other.",
    ["reason"],
)
KV_TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_seconds",
    "Duration of one request's KV transfer, first chunk to commit.",
    buckets=TRANSFER_BUCKETS,
)

# gRPC status names (as KV-transfer errors spell them) -> KV_TRANSFER_FAILURES reason.
_FAILURE_REASONS = {
    "DEADLINE_EXCEEDED": "timeout",
    "DATA_LOSS": "checksum",
    "UNAVAILABLE": "connection",
    "NOT_FOUND": "rejected",
    "FAILED_PRECONDITION": "rejected",
    "INVALID_ARGUMENT": "rejected",
    "UNAUTHENTICATED": "rejected",
    "PERMISSION_DENIED": "rejected",
    "ActorDiedError": "worker_died",
    "RayActorError": "worker_died",
    "ActorUnavailableError": "worker_died",
}


def transfer_failure_reason(error: BaseException | str) -> str:
    """The KV_TRANSFER_FAILURES label of a failed transfer, from its error (or its text):
    transports raise KVTransferError with the gRPC status name in the message."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return next((reason for key, reason in _FAILURE_REASONS.items() if key in text), "other")
