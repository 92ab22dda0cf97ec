"""The decode side's table of open transfers, shared by every transport.

Owns each transfer's lifecycle: OPEN -> COMMITTED | ABORTED | EXPIRED | FAILED, changed only
here. A chunk may carry a part of the cache's KV heads (a tensor-parallel handoff: each prefill
rank sends the heads it holds), so arrival is tracked per (layer, head), and chunk order per
stream of one first head. Invariants: only an OPEN transfer's blocks are written; a state change away from OPEN
happens under the transfer's lock, which every write also holds, so once `abort` returns or
`on_expired` is called no write into its blocks is in flight (fencing); every transfer that
does not commit ends in `sink.on_expired` (or in its owner's own `abort`), so no blocks leak.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kv_transfer.base import CommitInfo, KVLayout, KVSink

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_MAX_TOMBSTONES = 4096  # ended ids remembered, so late chunks get a precise rejection


class TransferState(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"
    EXPIRED = "expired"
    FAILED = "failed"


class RejectReason(enum.Enum):
    """Why a call on a transfer was refused; transports map these onto their status codes."""

    NOT_FOUND = "not_found"  # never issued (or forgotten long ago)
    NOT_OPEN = "not_open"  # expired, aborted, failed or already committed
    INVALID = "invalid"  # chunk does not fit the reservation (layers, dtype, shape)
    CORRUPT = "corrupt"  # checksum mismatch
    INCOMPLETE = "incomplete"  # commit before every layer arrived
    COMMIT_FAILED = "commit_failed"  # the sink refused the commit


class TransferRejected(Exception):
    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # picklable: a decode rank's refusal reaches rank 0 through Ray
        return TransferRejected, (self.reason, str(self))


@dataclass(frozen=True)
class ChunkSpec:
    """What a chunk claims to be, from its header."""

    layer_start: int
    layer_end: int
    num_layers: int
    dtype: str
    shape: tuple[int, ...]  # [l1-l0, 2, n, block_size, num_kv_heads, head_dim]
    seq: int = 0  # position of the chunk in its stream (the chunks of one kv_head_start)
    kv_head_start: int = 0  # the model's index of the chunk's first KV head


@dataclass
class _Transfer:
    transfer_id: str
    dest_block_ids: list[int]
    deadline: float  # time.monotonic()
    trace_context: dict[str, str]
    # (num_layers, dtype, (block_size, head_dim)) every chunk must match, and (first, count)
    # of the model's KV heads the cache holds; from the layout, else from the first chunk.
    expect: tuple[int, str, tuple[int, ...]] | None
    heads: tuple[int, int] | None
    arrived: bytearray | None = None  # one flag per (layer, head), layer-major
    next_seq: dict[int, int] = field(default_factory=dict)  # by kv_head_start: next chunk's seq
    state: TransferState = TransferState.OPEN
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


def _cells(transfer: _Transfer, spec: ChunkSpec) -> list[slice]:
    """The chunk's (layer, head) flags in `transfer.arrived`: one run of heads per layer."""
    assert transfer.heads is not None
    first, count = transfer.heads
    start = spec.kv_head_start - first
    return [
        slice(layer * count + start, layer * count + start + spec.shape[4])
        for layer in range(spec.layer_start, spec.layer_end)
    ]


class ReservationTable:
    """Thread-safe table of transfers with a reaper thread that expires them at their deadline."""

    def __init__(
        self, sink: KVSink, layout: KVLayout | None, default_timeout_s: float, reap_s: float = 0.05
    ) -> None:
        self._sink = sink
        self._layout = layout
        self._default_timeout_s = default_timeout_s
        self._open: dict[str, _Transfer] = {}
        self._ended: OrderedDict[str, tuple[TransferState, str]] = OrderedDict()  # state, error
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap_loop, args=(reap_s,), name="kv-reaper", daemon=True
        )
        self._reaper.start()

    def open(
        self,
        dest_block_ids: list[int],
        deadline_s: float | None,
        trace_context: dict[str, str],
        transfer_id: str | None = None,
    ) -> str:
        """A new transfer's id; `transfer_id` (another rank of this decode worker issued it)
        opens this rank's part of a tensor-parallel handoff under the same id."""
        timeout = self._default_timeout_s if deadline_s is None else deadline_s
        expect = heads = None
        if self._layout is not None:
            lay = self._layout
            expect = (lay.num_layers, lay.dtype, (lay.block_size, lay.head_dim))
            heads = (lay.first_kv_head, lay.num_kv_heads)
        transfer_id = transfer_id or secrets.token_urlsafe(24)  # 192 bits: a capability
        transfer = _Transfer(
            transfer_id,
            list(dest_block_ids),
            time.monotonic() + timeout,
            dict(trace_context),
            expect,
            heads,
        )
        with self._lock:
            self._open[transfer_id] = transfer
        return transfer_id

    def validate(self, transfer_id: str, spec: ChunkSpec) -> None:
        """Raises TransferRejected unless a chunk like `spec` may be written now; every chunk is
        validated exactly once, in order. An invalid chunk fails the transfer (the sender is
        broken or hostile; nothing of it may be committed)."""
        transfer = self._get_open(transfer_id)
        with transfer.lock:
            self._check_open(transfer)
            problem = self._check_spec(transfer, spec)
            expected = transfer.next_seq.get(spec.kv_head_start, 0)
            if not problem and spec.seq != expected:
                problem = (
                    f"transfer {transfer_id}: chunk seq {spec.seq} out of order, "
                    f"expected {expected}"
                )
            transfer.next_seq[spec.kv_head_start] = expected + 1
        if problem:
            self.fail(transfer_id, problem, RejectReason.INVALID)

    def write(self, transfer_id: str, spec: ChunkSpec, data: torch.Tensor) -> None:
        """Validates and writes one chunk into the reservation's blocks via the sink."""
        transfer = self._get_open(transfer_id)
        with transfer.lock:
            self._check_open(transfer)
            problem = self._check_spec(transfer, spec)
            if not problem:
                assert transfer.heads is not None and transfer.arrived is not None
                own_head = spec.kv_head_start - transfer.heads[0]  # the cache's index
                self._sink.write_kv(
                    transfer_id, transfer.dest_block_ids, spec.layer_start, data, own_head
                )
                for cells in _cells(transfer, spec):
                    transfer.arrived[cells] = b"\x01" * (cells.stop - cells.start)
                return
        self.fail(transfer_id, problem, RejectReason.INVALID)

    def commit(self, transfer_id: str, info: CommitInfo) -> None:
        transfer = self._get_open(transfer_id)
        with transfer.lock:
            self._check_open(transfer)
            # A reservation with no blocks (the decode worker holds the whole prompt) needs
            # no chunks: only the commit.
            self._check_complete(transfer)
            try:
                self._sink.on_commit(transfer_id, info)
            except Exception as exc:
                error = f"transfer {transfer_id}: commit refused: {exc}"
                # ValueError: a Commit field does not fit the reservation (the sender's fault).
                reason = (
                    RejectReason.INVALID
                    if isinstance(exc, ValueError)
                    else RejectReason.COMMIT_FAILED
                )
            else:
                self._end(transfer, TransferState.COMMITTED)
                return
        self.fail(transfer_id, error, reason)

    def seal(self, transfer_id: str) -> None:
        """Ends a complete transfer as COMMITTED without the sink's on_commit: this rank's part
        of a tensor-parallel handoff, whose commit (the first token, decoding) is rank 0's.
        Raises TransferRejected (INCOMPLETE, NOT_OPEN...) otherwise, changing nothing."""
        transfer = self._get_open(transfer_id)
        with transfer.lock:
            self._check_open(transfer)
            self._check_complete(transfer)
            self._end(transfer, TransferState.COMMITTED)

    def abort(self, transfer_id: str, notify_sink: bool) -> bool:
        """Fences the transfer; True if it was open. `notify_sink` calls on_expired (remote
        aborts: the decode worker did not ask, so it must learn its blocks are free)."""
        with self._lock:
            transfer = self._open.get(transfer_id)
        if transfer is None:
            return False
        with transfer.lock:
            if transfer.state is not TransferState.OPEN:
                return False
            self._end(transfer, TransferState.ABORTED)
        if notify_sink:
            self._notify_expired(transfer_id)
        return True

    def fail(self, transfer_id: str, message: str, reason: RejectReason) -> None:
        """Ends an open transfer as FAILED (the sink frees its blocks) and raises the rejection."""
        with self._lock:
            transfer = self._open.get(transfer_id)
        ended = False
        if transfer is not None:
            with transfer.lock:
                if transfer.state is TransferState.OPEN:
                    transfer.error = message
                    self._end(transfer, TransferState.FAILED)
                    ended = True
        if ended:
            log.warning("KV transfer failed: %s", message)
            self._notify_expired(transfer_id)
        raise TransferRejected(reason, message)

    def state(self, transfer_id: str) -> TransferState | None:
        with self._lock:
            transfer = self._open.get(transfer_id)
            if transfer is not None:
                return transfer.state
            ended = self._ended.get(transfer_id)
            return ended[0] if ended else None

    def trace_context(self, transfer_id: str) -> dict[str, str]:
        with self._lock:
            transfer = self._open.get(transfer_id)
            return dict(transfer.trace_context) if transfer else {}

    def deadline(self, transfer_id: str) -> float | None:
        """The transfer's deadline on the time.monotonic() clock, if it is open."""
        with self._lock:
            transfer = self._open.get(transfer_id)
            return transfer.deadline if transfer else None

    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._open)

    def close(self) -> None:
        self._stop.set()
        self._reaper.join(timeout=2)

    # -- internals --------------------------------------------------------------------------

    def _get_open(self, transfer_id: str) -> _Transfer:
        with self._lock:
            transfer = self._open.get(transfer_id)
            ended = self._ended.get(transfer_id)
        if transfer is None:
            if ended is None:
                raise TransferRejected(RejectReason.NOT_FOUND, f"unknown transfer {transfer_id!r}")
            state, error = ended
            detail = f": {error}" if error else ""
            raise TransferRejected(
                RejectReason.NOT_OPEN, f"transfer {transfer_id} is {state.value}{detail}"
            )
        if time.monotonic() >= transfer.deadline:
            self._expire(transfer)
        return transfer

    @staticmethod
    def _check_open(transfer: _Transfer) -> None:
        if transfer.state is not TransferState.OPEN:
            detail = f": {transfer.error}" if transfer.error else ""
            raise TransferRejected(
                RejectReason.NOT_OPEN,
                f"transfer {transfer.transfer_id} is {transfer.state.value}{detail}",
            )

    @staticmethod
    def _check_complete(transfer: _Transfer) -> None:
        """Raises INCOMPLETE unless every (layer, head) arrived. A reservation with no blocks
        (the decode worker holds the whole prompt) needs no chunks."""
        if not transfer.dest_block_ids:
            return
        if transfer.arrived is None or not all(transfer.arrived):
            tid = transfer.transfer_id
            if transfer.arrived is None:
                missing = "all layers missing"
            else:
                heads = transfer.heads[1] if transfer.heads else 1
                cells = [i for i, flag in enumerate(transfer.arrived) if not flag]
                layers = len({i // heads for i in cells})
                missing = f"{layers} layers missing ({len(cells)} (layer, KV head) parts)"
            raise TransferRejected(RejectReason.INCOMPLETE, f"transfer {tid}: {missing}")

    @staticmethod
    def _check_spec(transfer: _Transfer, spec: ChunkSpec) -> str:
        """'' if the chunk fits the reservation, else what is wrong. Sets `expect`, `heads`
        and `arrived` from the first chunk when the receiver has no layout."""
        tid, n = transfer.transfer_id, len(transfer.dest_block_ids)
        if len(spec.shape) != 6:
            return f"transfer {tid}: chunk shape {list(spec.shape)} is not 6-dimensional"
        claimed = (spec.num_layers, spec.dtype, (spec.shape[3], spec.shape[5]))
        expect = transfer.expect or claimed
        if claimed != expect:
            return (
                f"transfer {tid}: chunk (layers, dtype, (block size, head dim)) {claimed} "
                f"!= {expect}"
            )
        first, count = transfer.heads or (spec.kv_head_start, spec.shape[4])
        start, end = spec.kv_head_start, spec.kv_head_start + spec.shape[4]
        if not first <= start < end <= first + count:
            return (
                f"transfer {tid}: chunk KV heads [{start}, {end}) are not within this cache's "
                f"heads [{first}, {first + count})"
            )
        if not 0 <= spec.layer_start < spec.layer_end <= expect[0]:
            return f"transfer {tid}: layer range [{spec.layer_start}, {spec.layer_end}) invalid"
        want = (spec.layer_end - spec.layer_start, 2, n)
        if tuple(spec.shape[:3]) != want:
            return (
                f"transfer {tid}: chunk shape {list(spec.shape)} does not start with {list(want)}"
            )
        transfer.expect, transfer.heads = expect, (first, count)
        if transfer.arrived is None:
            transfer.arrived = bytearray(expect[0] * count)
        if any(any(transfer.arrived[cells]) for cells in _cells(transfer, spec)):
            return (
                f"transfer {tid}: layers [{spec.layer_start}, {spec.layer_end}) of KV heads "
                f"[{start}, {end}) sent twice"
            )
        return ""

    def _end(self, transfer: _Transfer, state: TransferState) -> None:
        """Moves an OPEN transfer to a final state. Caller holds transfer.lock."""
        transfer.state = state
        with self._lock:
            self._open.pop(transfer.transfer_id, None)
            self._ended[transfer.transfer_id] = (state, transfer.error)
            while len(self._ended) > _MAX_TOMBSTONES:
                self._ended.popitem(last=False)

    def _expire(self, transfer: _Transfer) -> None:
        with transfer.lock:
            if transfer.state is not TransferState.OPEN:
                return
            self._end(transfer, TransferState.EXPIRED)
        log.info("KV transfer %s expired before commit", transfer.transfer_id)
        self._notify_expired(transfer.transfer_id)

    def _notify_expired(self, transfer_id: str) -> None:
        try:
            self._sink.on_expired(transfer_id)
        except Exception:  # the sink's bug must not kill the reaper or a gRPC thread
            log.exception("KVSink.on_expired(%s) raised", transfer_id)

    def _reap_loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            now = time.monotonic()
            with self._lock:
                due = [t for t in self._open.values() if t.deadline <= now]
            for transfer in due:
                self._expire(transfer)
