"""`PeerPrefixes`: the engine's two sides of a peer pull (docs/design.md, "Peer pull").

The holder X *pins* the blocks of a prefix it caches (references taken, host and disk blocks
brought back as a local hit would) so they cannot be evicted while its sender reads them, and
unpins them once sent. The puller Y, whose reservation of the request's whole block table
received blocks [h_Y, h_X) from X, *commits the prefix*: those blocks join its prefix cache
(unless it does not cache received KV), the sequence counts h_X blocks as computed and runs
the rest of the prompt as a local prefill. When the pull fails (refusal, dead or slow peer)
Y *falls back*: the same sequence runs from its own hits h_Y, so it still finishes.
All methods run on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.decoding.forked_choices import ForkedChoices
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus

# Pins are not requests: their ids never meet the engine's request ids.
_PIN_ARRIVAL = -1


class PeerPrefixes:
    def __init__(
        self,
        seqs: dict[str, Sequence],
        scheduler: Scheduler,
        block_manager: BlockManager,
        forks: ForkedChoices,
        fence_host_copies: Callable[[], None],
    ) -> None:
        self._seqs = seqs  # the engine's requests, by id
        self._scheduler = scheduler
        self._block_manager = block_manager
        self._forks = forks
        self._fence_host_copies = fence_host_copies
        self._pins: dict[str, Sequence] = {}  # by push id: the blocks a push reads
        self.peer_hit_tokens = 0  # prompt tokens pulled from peers instead of computed
        self.pulls_started = 0  # reservations made for a pull (LLMEngine.reserve)
        self.pulls_committed = 0
        self.pulls_fallen_back = 0

    # ---- the holder X ---------------------------------------------------------------------
    def pin(self, push_id: str, token_ids: Seq[int]) -> list[int] | None:
        """The block ids of the full blocks of `token_ids`, referenced until `unpin(push_id)`;
        None (nothing held) unless this cache holds every one of them with these tokens."""
        if push_id in self._pins:
            raise ValueError(f"push {push_id!r} is already pinning blocks")
        pin = Sequence(push_id, list(token_ids), len(token_ids), SamplingParams(), _PIN_ARRIVAL)
        wanted = len(token_ids) // self._block_manager.block_size
        self._block_manager.acquire_prefix(pin, wanted * self._block_manager.block_size)
        if len(pin.block_table) < wanted:
            self._block_manager.release(pin)
            return None
        self._fence_host_copies()  # blocks brought back from the host are read on another thread
        self._pins[push_id] = pin
        return list(pin.block_table)

    def unpin(self, push_id: str) -> None:
        pin = self._pins.pop(push_id, None)
        if pin is not None:
            self._block_manager.release(pin)

    # ---- the puller Y ---------------------------------------------------------------------
    def commit_prefix(self, request_id: str, pulled_blocks: int, cache_blocks: bool) -> None:
        """Blocks up to `pulled_blocks` of the reserved request hold its prompt's KV: they are
        computed, the rest of the prompt is prefilled here."""
        seq = self._reserved(request_id)
        size = self._block_manager.block_size
        pulled_tokens = pulled_blocks * size
        if not seq.num_cached_tokens < pulled_tokens < seq.num_prompt_tokens:
            raise ValueError(
                f"a pull of {pulled_blocks} blocks does not extend the {seq.num_cached_tokens} "
                f"cached tokens of a {seq.num_prompt_tokens}-token prompt"
            )
        seq.cache_blocks = cache_blocks
        seq.num_computed_tokens = pulled_tokens
        self._block_manager.cache_full_blocks(seq)
        peer = pulled_tokens - seq.num_cached_tokens
        seq.num_cached_tokens = pulled_tokens
        self._scheduler.prefix_hit_tokens += peer
        self.peer_hit_tokens += peer
        self.pulls_committed += 1
        self._run(seq)

    def fall_back(self, request_id: str) -> bool:
        """The pull into the reserved request ended without its blocks: it prefills from its
        own hits. False (nothing done) when it is no longer reserved (aborted, committed)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.RESERVED:
            return False
        # The blocks past the hits hold whatever arrived; the prefill overwrites them.
        seq.num_computed_tokens = seq.num_cached_tokens
        self.pulls_fallen_back += 1
        self._run(seq)
        return True

    def _reserved(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.RESERVED:
            raise KeyError(f"request {request_id!r} has no reservation to commit")
        return seq

    def _run(self, seq: Sequence) -> None:
        """A reserved sequence with its blocks continues its prefill among the running ones,
        its choices set up as `LLMEngine.add_request` does."""
        if seq.params.beam_search:
            self._forks.start_beams(seq)
        elif seq.params.n > 1:
            seq.pending_forks = list(range(1, seq.params.n))
        self._scheduler.add_running(seq)
