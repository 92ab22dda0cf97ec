"""`KVHandoff`: the decode side of a KV handoff (docs/structures.md, "Engine"). A request whose
prompt KV is computed elsewhere is *reserved* (its whole block table allocated, prefix-cache
hits reused), its blocks are written by a transfer on another thread, and it is *committed*
(its first token appended) to join the running batch. `LLMEngine.reserve` and `commit`
delegate here and emit the KV events; everything here runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.decoding.forked_choices import ForkedChoices
from pdserve.engine.outputs import RequestOutput, Reservation
from pdserve.engine.peer_prefixes import PeerPrefixes
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step_outputs import StepOutputs


class KVHandoff:
    def __init__(
        self,
        seqs: dict[str, Sequence],
        new_sequence: Callable[[str, Seq[int], SamplingParams, bool], Sequence],
        executor: Any,
        scheduler: Scheduler,
        block_manager: BlockManager,
        forks: ForkedChoices,
        step_outputs: StepOutputs,
        peer_prefixes: PeerPrefixes,
        fence_host_copies: Callable[[], None],
    ) -> None:
        self._seqs = seqs  # the engine's requests, by id
        self._new_sequence = new_sequence  # the engine's: checks the id is free
        self._executor = executor
        self._scheduler = scheduler
        self._block_manager = block_manager
        self._forks = forks
        self._step_outputs = step_outputs
        self._peer_prefixes = peer_prefixes
        self._fence_host_copies = fence_host_copies

    def reserve(
        self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, pull: bool
    ) -> Reservation | None:
        """Allocates the prompt's whole block table, reusing prefix-cache hits; None when
        there is no room now. Blocks from `missing_block_indices` on must be written. A `pull`
        (of a prefix from a peer) ends in `commit_prefix` or `fall_back`, which prefill at
        least the last prompt token here, so its hits stop before that token."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, False)
        reusable = seq.num_tokens - 1 if pull else seq.num_tokens
        cached = self._block_manager.acquire_prefix(seq, reusable)
        if not self._block_manager.ensure_blocks(seq, seq.num_tokens):
            self._block_manager.release(seq)
            return None
        self._fence_host_copies()  # before the transfer writes the blocks (another thread)
        seq.status = SequenceStatus.RESERVED
        seq.admitted = True
        seq.num_cached_tokens = cached
        sched = self._scheduler
        sched.prefix_hit_tokens += cached
        sched.prefix_host_hit_tokens += seq.num_host_hit_tokens
        sched.prefix_disk_hit_tokens += seq.num_disk_hit_tokens
        sched.prefix_query_tokens += seq.num_prompt_tokens
        self._seqs[request_id] = seq
        self._forks.track(request_id, params)
        self._peer_prefixes.pulls_started += pull
        missing = list(range(cached // self._block_manager.block_size, len(seq.block_table)))
        return Reservation(cached, list(seq.block_table), missing)

    def commit(
        self,
        request_id: str,
        first_token_id: int,
        first_logprob: float | None,
        cache_blocks: bool,
    ) -> RequestOutput | None:
        """The reserved prompt's KV is complete: cache its full blocks (unless `cache_blocks`
        is False: KV from an untrusted peer then serves only this request), append the first
        token (whose text the prefill side already emitted) and join the running batch.
        Returns the request's final output when that first token already ended it (the
        engine delivers it at its next step). Raises KeyError without a reservation and
        ValueError for a first token outside the vocabulary, changing nothing."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.RESERVED:
            raise KeyError(f"request {request_id!r} has no reservation to commit")
        vocab = self._executor.vocab_size
        if not 0 <= first_token_id < vocab:
            raise ValueError(
                f"first_token_id {first_token_id} is outside the vocabulary [0, {vocab})"
            )
        seq.cache_blocks = cache_blocks
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._block_manager.cache_full_blocks(seq)
        if seq.params.beam_search:  # the search needs the last prompt position's candidates
            seq.num_computed_tokens = seq.num_prompt_tokens - 1
            self._forks.start_beams(seq)
            self._scheduler.add_running(seq)
            return None
        if seq.params.n > 1:  # choice 1 recomputes the last prompt position, then forks
            second = self._forks.fork(seq, 1)
            second.num_computed_tokens = seq.num_prompt_tokens - 1
            second.pending_forks = list(range(2, seq.params.n))
        out = self._step_outputs.append_tokens(seq, [first_token_id], [first_logprob])
        if not out.finished:
            self._scheduler.add_running(seq)
            return None
        # The first token already ended it: report the end, not the token.
        return RequestOutput(
            request_id,
            finished=True,
            finish_reason=out.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            open_choices=out.open_choices,
        )
