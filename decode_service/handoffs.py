"""The decode worker's in-flight handoffs: one record per reserved request until it is committed,
aborted or expired.

A record is created when reserve() starts (before its first await), so an abort that races the
reservation finds it and marks it cancelled; reserve() then undoes what it allocated. The
receiver's threads select a record by the transfer id every KV chunk and the commit carry.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

    from kv_transfer.base import CommitInfo


@dataclass
class Handoff:
    """One request's KV handoff into this worker: reservation, transfer, trace, timings."""

    request_id: str
    num_prompt_tokens: int
    reserved_ns: int  # time.time_ns() when reserve() started
    wants_logprobs: bool
    transfer_id: str = ""  # set once the receiver opened the transfer
    blocks: int = 0  # blocks the prefill worker sends
    reserve_span: SpanContext | None = None  # linked from the kv_receive span
    first_chunk_ns: int | None = None  # when its first KV chunk landed: kv_receive starts there
    cancelled: bool = False  # abort() arrived; reserve() must undo its reservation
    # A peer pull (docs/design.md): the prompt's blocks up to this one come from a peer, whose
    # commit carries no token; a failed pull falls back to a local prefill. 0: a handoff.
    pulled_blocks: int = 0

    def check_commit(self, commit: CommitInfo) -> None:
        """Raises ValueError naming the Commit field that does not fit this reservation (the
        first token's range is checked by the engine, which knows the vocabulary). A pull's
        commit has nothing to check: the reservation decides what it means."""
        if self.pulled_blocks:
            return
        if commit.num_prompt_tokens != self.num_prompt_tokens:
            raise ValueError(
                f"num_prompt_tokens is {commit.num_prompt_tokens}, the reservation holds a "
                f"prompt of {self.num_prompt_tokens} tokens"
            )
        logprob = commit.first_logprob
        if logprob is None:
            if self.wants_logprobs:
                raise ValueError("first_logprob is missing and the request asked for logprobs")
        elif not logprob <= 0.0:  # also catches NaN
            raise ValueError(f"first_logprob {logprob} is not a log-probability (<= 0)")


class HandoffTable:
    """Handoffs by request id and by transfer id; safe to use from the event loop and the
    receiver's threads at once."""

    def __init__(self) -> None:
        self._by_request: dict[str, Handoff] = {}
        self._by_transfer: dict[str, Handoff] = {}
        self._lock = threading.Lock()

    def begin(self, request_id: str, num_prompt_tokens: int, wants_logprobs: bool) -> Handoff:
        handoff = Handoff(request_id, num_prompt_tokens, time.time_ns(), wants_logprobs)
        with self._lock:
            self._by_request[request_id] = handoff
        return handoff

    def attach(self, handoff: Handoff, transfer_id: str, blocks: int) -> None:
        """Records the transfer opened for `handoff`: its chunks and commit select it now."""
        with self._lock:
            handoff.transfer_id, handoff.blocks = transfer_id, blocks
            self._by_transfer[transfer_id] = handoff

    def by_request(self, request_id: str) -> Handoff | None:
        with self._lock:
            return self._by_request.get(request_id)

    def of_transfer(self, transfer_id: str) -> Handoff | None:
        with self._lock:
            return self._by_transfer.get(transfer_id)

    def end(self, handoff: Handoff) -> None:
        """Forgets a handoff whose KV arrived or whose transfer ended."""
        with self._lock:
            if self._by_request.get(handoff.request_id) is handoff:
                del self._by_request[handoff.request_id]
            if handoff.transfer_id and self._by_transfer.get(handoff.transfer_id) is handoff:
                del self._by_transfer[handoff.transfer_id]

    def cancel(self, request_id: str) -> Handoff | None:
        """Marks the request's handoff cancelled and forgets it; returns it (None if none)."""
        with self._lock:
            handoff = self._by_request.pop(request_id, None)
            if handoff is None:
                return None
            handoff.cancelled = True
            if handoff.transfer_id:
                self._by_transfer.pop(handoff.transfer_id, None)
            return handoff

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_request)
