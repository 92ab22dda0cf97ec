"""Scheduler: which sequences run in the next step, and how many of their tokens.

Continuous batching under a token budget: running sequences go first (a decode costs one
token, an unfinished chunked prefill continues), then waiting ones are admitted in arrival
order while budget, `max_num_seqs` and free blocks last. A long prompt is split across steps
(chunked prefill). When a running sequence cannot get a block, the latest-arrived running
sequence is preempted: its blocks are released (full ones stay in the prefix cache) and it
goes back to the front of the queue to be recomputed. Reserved and held sequences are in
neither queue. Before a running sequence writes into a block another fork shares, the block is
copied (BlockManager.copy_on_write): the batch lists the copies, made before the step runs.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus

_ARRIVAL = attrgetter("arrival")
# An enum member read through its class costs ~0.09 us on Python 3.11 (a descriptor call), a
# module global ~0.01: `schedule` compares one per running sequence per step.
_RUNNING = SequenceStatus.RUNNING


@dataclass
class Verified:
    """One sequence's verified speculative drafts: the tokens to append, the accepted drafts
    first, then the target's own."""

    token_ids: list[int]
    logprobs: list[float] | None  # when the request asked for logprobs
    num_accepted: int  # drafts accepted (len(token_ids) - 1)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens to compute, per sequence
    preempted: list[Sequence] = field(default_factory=list)  # sent back to be recomputed
    # (source, destination) block copies to make before the step (copy-on-write of forks).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (index in seqs, fork): forks that sample their first token from that sequence's logits.
    fork_samples: list[tuple[int, Sequence]] = field(default_factory=list)
    # Filled by the executor: sample index -> a beam's best (token, log-probability) pairs.
    beam_candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # Filled by the executor: sample index -> the verification of that sequence's speculative
    # drafts (speculation/verification.py), for sequences with num_draft_tokens > 0.
    verified: dict[int, Verified] = field(default_factory=dict)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(num_tokens)

    def sampling_seq(self, i: int) -> Sequence:
        """The sequence of sample index i: seqs[i], or past them the forks of fork_samples."""
        if i < len(self.seqs):
            return self.seqs[i]
        return self.fork_samples[i - len(self.seqs)][1]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order: preemption takes the tail
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0  # in any tier
        self.prefix_host_hit_tokens = 0  # of those, brought back from the host tier
        self.prefix_disk_hit_tokens = 0  # and those read back from the disk tier
        self.prefix_query_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A committed decode handoff joins the running sequences directly (its prompt is
        computed); it takes a place in a step once fewer than max_num_seqs run before it."""
        seq.status = SequenceStatus.RUNNING
        # `running` is in arrival order: placing it costs a search, not a sort of them all
        # (a decode worker's running list can hold thousands of committed handoffs).
        bisect.insort(self.running, seq, key=_ARRIVAL)

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or aborted sequence out of its queue (its blocks are not touched)."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        running, max_seqs = self.running, self.max_num_seqs
        writable = self.block_manager.writable
        i = 0
        # Committed handoffs and forks join `running` directly, so it can hold more than
        # max_num_seqs: the earliest arrivals run, the rest wait in place with their blocks.
        # (This loop runs once per running sequence per step: it reads fields, not properties.)
        while i < len(running) and budget > 0 and len(batch.seqs) < max_seqs:
            seq = running[i]
            start = seq.num_computed_tokens
            n = len(seq.token_ids) - start
            if n > budget:  # (a comparison: min() costs a call per running sequence)
                n = budget
            if seq.num_draft_tokens:  # drafts take only budget no later running one needs
                later = min(len(running), max_seqs) - len(batch.seqs) - 1
                n = min(n, max(seq.num_uncomputed_tokens - seq.num_draft_tokens, budget - later))
            if n == 0:  # a beam whose siblings have not computed yet: it waits for them
                i += 1
                continue
            # The usual decode step needs nothing: its blocks are there and its own.
            while not (writable(seq, start, start + n) or self._make_writable(seq, n, batch)):
                without_drafts = seq.num_uncomputed_tokens - seq.num_draft_tokens
                if n > without_drafts:  # its drafts go before anyone is preempted
                    n = without_drafts
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not _RUNNING:
                break  # it preempted itself: everything after it is gone too
            batch.add(seq, n)
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # no room for newcomers when running ones were just evicted
        if self.waiting and budget > 0 and len(running) < max_seqs:
            self._admit_waiting(batch, budget)
        if not batch.seqs and self.waiting:
            batch.preempted += self._evict_idle()
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Waiting sequences join `running` (kept in arrival order) and the batch while the
        budget and max_num_seqs allow."""
        # Full prompt blocks that running sequences are still computing: a newcomer whose next
        # block is among them waits a step and then finds it in the prefix cache, instead of
        # computing the same shared prefix a second time in parallel.
        in_flight = {h for seq in self.running for h in self._uncomputed_prompt_hashes(seq)}
        admitted = False
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._next_block_in_flight(seq, in_flight):
                continue  # it keeps its place; later arrivals may go ahead meanwhile
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
            in_flight.update(self._uncomputed_prompt_hashes(seq))
            admitted = True
        if admitted:  # a recomputed (preempted) sequence arrived before some running ones
            self.running.sort(key=_ARRIVAL)

    def _evict_idle(self) -> list[Sequence]:
        """Nothing could run: the running sequences all wait (beams whose siblings are
        preempted) and hold the blocks the waiting ones need. They go to the back of the queue
        (their offers stay valid), so the waiting siblings get the room to compute. Returns
        them."""
        idle = [s for s in self.running if s.num_uncomputed_tokens == 0]
        for seq in idle:
            self._preempt(seq)
            self.waiting.remove(seq)
            self.waiting.append(seq)
        return idle

    def _make_writable(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for the next n tokens of a running sequence, none shared with another fork
        (copies go to the batch); False when there is no room. (`schedule` first asks
        BlockManager.writable, which tells at less cost that nothing is to be done.)"""
        start = seq.num_computed_tokens
        if not self.block_manager.ensure_blocks(seq, start + n):
            return False
        copies = self.block_manager.copy_on_write(seq, start, start + n)
        if copies is None:
            return False
        batch.block_copies += copies
        return True

    def _uncomputed_prompt_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full prompt blocks of `seq` not computed yet (empty when caching is
        off: then nothing is shared and nothing is worth waiting for)."""
        if not self.block_manager.enable_prefix_caching:
            return []
        size = self.block_manager.block_size
        return self.block_manager.prompt_hashes(seq)[seq.num_computed_tokens // size :]

    def _next_block_in_flight(self, seq: Sequence, in_flight: set[int]) -> bool:
        """True when the first prompt block `seq` would compute is being computed now."""
        if not in_flight:
            return False
        is_cached = self.block_manager.is_cached
        pending = self._uncomputed_prompt_hashes(seq)
        first_missing = next((h for h in pending if not is_cached(h)), None)
        return first_missing in in_flight

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Blocks for the next chunk of a waiting sequence; the chunk's size, 0 = not now."""
        # At least the last token must be computed: its logits give the next token.
        seq.num_computed_tokens = self.block_manager.acquire_prefix(seq, seq.num_tokens - 1)
        n = min(seq.num_uncomputed_tokens, budget)
        too_long = n < seq.num_uncomputed_tokens and not self.enable_chunked_prefill
        if too_long or not self.block_manager.ensure_blocks(seq, seq.num_computed_tokens + n):
            self.block_manager.release(seq)
            seq.num_computed_tokens = 0
            return 0
        if not seq.admitted:  # a preempted sequence's recompute is not a new query
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_hit_tokens += seq.num_cached_tokens
            self.prefix_host_hit_tokens += seq.num_host_hit_tokens
            self.prefix_disk_hit_tokens += seq.num_disk_hit_tokens
            self.prefix_query_tokens += seq.num_prompt_tokens
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
