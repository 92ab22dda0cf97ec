"""ForkedChoices: the engine's requests that run as several sequences sharing KV blocks — their
n choices and their beams.

A request with n > 1 is prefilled once: in the step that computes its last prompt token, its
sequence forks n - 1 more (choice i seeded with seed + i), which share its KV blocks and
sample their first tokens from its logits; a block is copied only when a fork writes into a
partly filled block that another still holds. On the decode side of a handoff the prefill
worker sampled choice 0's first token only: commit() forks choice 1 with the last prompt
position uncomputed, recomputes it (into a private copy of its block) and forks the other
choices from it, so every choice draws its first token as a single request would.

Beam search (beam_width >= 2, pdserve/engine/decoding/beam_search.py) runs its beams as forked
sequences in the same batch: each step every beam's row offers its best candidates instead of
a sampled token; once all beams of the request computed, the search keeps the best and the
engine re-forks: a beam continued by several candidates forks (blocks shared, the partial last
block copied on write), one continued by none is freed, and nothing is emitted until the
search ends with its best n beams (one output each, `index` 0 = best). The torch executor
offers candidates; the sim executor does not, and refuses beam requests.

`LLMEngine` (engine.py) owns one `ForkedChoices` and calls it when a request arrives or is
reserved (`track`, `start_beams`), when a step is scheduled (`fork_pending`), when a handoff
commits (`fork`) and on abort (`abort`); `StepOutputs` (step_outputs.py) calls it when a choice
finishes (`close_choice`) and when a beam offers its candidates (`beams`, `beam_step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.decoding.beam_search import BeamRequest, BeamSearch
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.tokenizer import IncrementalDetokenizer

Detokenizers = Callable[[list[int], SamplingParams], IncrementalDetokenizer | None]


class ForkedChoices:
    def __init__(
        self,
        requests: dict[str, Sequence],
        scheduler: Scheduler,
        block_manager: BlockManager,
        finish: Callable[[Sequence, str], None],
        detokenizer: Detokenizers,
        arrivals: Iterator[int],
        eos_token_ids: set[int],
        max_model_len: int,
    ) -> None:
        """`requests`: the engine's, by request id (choice 0's sequence), shared: a request is
        forgotten when its last choice or its beam search ends. `finish(seq, reason)` frees a
        sequence (the engine's); `detokenizer(prompt, params)` makes a fork's; `arrivals` numbers
        sequences in arrival order (the engine's counter)."""
        self._requests = requests
        self._scheduler = scheduler
        self._block_manager = block_manager
        self._finish = finish
        self._detokenizer = detokenizer
        self._arrivals = arrivals
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self.open_choices: dict[str, int] = {}  # choices still generating (n > 1), by request
        self._forks: dict[str, list[Sequence]] = {}  # the other choices' sequences (n > 1)
        self.beams: dict[str, BeamRequest] = {}  # beam-search requests by request id

    # ---- n choices ----------------------------------------------------------------------
    def track(self, request_id: str, params: SamplingParams) -> None:
        """A new request (added or reserved): its choices are counted when n > 1."""
        if params.n > 1 and not params.beam_search:
            self.open_choices[request_id] = params.n
            self._forks[request_id] = []

    def abort(self, request_id: str) -> None:
        """Frees the request's other choices and its beams."""
        self.open_choices.pop(request_id, None)
        for fork in self._forks.pop(request_id, []):
            self._finish(fork, "abort")
        beams = self.beams.pop(request_id, None)
        for beam in beams.seqs if beams else ():
            self._finish(beam, "abort")

    def close_choice(self, request_id: str) -> int:
        """Counts a finished choice; forgets the request after its last. Returns how many
        choices still generate."""
        left = self.open_choices.get(request_id, 1) - 1
        if left > 0:
            self.open_choices[request_id] = left
            return left
        del self._requests[request_id]
        self.open_choices.pop(request_id, None)
        self._forks.pop(request_id, None)
        return 0

    def fork_pending(self, batch: ScheduledBatch) -> None:
        """Forks the pending choices of each sequence whose last prompt token this step
        computes: after the scheduler's copy-on-write, so the step's writes land in blocks the
        forks share (the prompt's KV, which they all want)."""
        if not self.open_choices:  # only open n > 1 requests have choices to fork
            return
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            if not seq.pending_forks or seq.num_computed_tokens + n < seq.num_tokens:
                continue
            for index in seq.pending_forks:
                fork = self.fork(seq, index)
                fork.num_computed_tokens = seq.num_computed_tokens + n
                batch.fork_samples.append((i, fork))
            seq.pending_forks = []

    def fork(self, seq: Sequence, index: int) -> Sequence:
        """Choice `index` of seq's request, sharing seq's tokens and blocks, running."""
        params = self._requests[seq.request_id].params  # the request's: seed + index
        seed = None if params.seed is None else params.seed + index
        fork = self._forked(seq, dataclasses.replace(params, n=1, seed=seed), index)
        self._forks[seq.request_id].append(fork)
        return fork

    def _forked(self, seq: Sequence, params: SamplingParams, index: int) -> Sequence:
        """A new sequence with seq's tokens, computed KV (its blocks, shared) and queue: running
        next to it, or waiting to be recomputed when seq was preempted."""
        fork = Sequence(
            request_id=seq.request_id,
            token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            params=params,
            arrival=next(self._arrivals),
            index=index,
            admitted=True,
            num_cached_tokens=seq.num_cached_tokens,
            cache_blocks=seq.cache_blocks,
            detokenizer=self._detokenizer(seq.token_ids, params),
            beam_top_k=seq.beam_top_k,
            min_tokens_mask=seq.min_tokens_mask,
            grammar=seq.grammar.fork() if seq.grammar is not None else None,
        )
        if seq.status == SequenceStatus.RUNNING:
            self._block_manager.fork(seq, fork)
            fork.num_computed_tokens = seq.num_computed_tokens
            self._scheduler.add_running(fork)
        else:
            self._scheduler.add(fork)
        return fork

    # ---- beam search --------------------------------------------------------------------
    def start_beams(self, seq: Sequence) -> None:
        """Makes `seq` (the prompt, computed or not) the one running beam of its request."""
        params = seq.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self._eos_token_ids
        max_tokens = min(params.max_tokens, self._max_model_len - seq.num_prompt_tokens)
        search = BeamSearch(params, stop_ids, max_tokens)
        seq.beam_top_k = search.candidates_per_beam
        self.beams[seq.request_id] = BeamRequest(search, [seq])

    def beam_step(self, request_id: str) -> list[RequestOutput]:
        """Steps the search once every beam offered; forks, frees and extends the beams; at
        the end, the best n beams as outputs."""
        beams = self.beams[request_id]
        if any(id(seq) not in beams.offers for seq in beams.seqs):
            return []  # some beam has not computed yet (preempted, or out of budget)
        offers = [beams.offers[id(seq)] for seq in beams.seqs]
        beams.offers = {}
        running = beams.search.step(offers)
        if beams.search.done:
            return self._finish_beams(request_id)
        parents, continued = beams.seqs, set()
        children = []
        for beam in running:  # first every fork, from parents without their new token
            parent = parents[beam.parent]
            if beam.parent in continued:
                children.append(self._forked(parent, parent.params, 0))
            else:
                continued.add(beam.parent)
                children.append(parent)
        for b, parent in enumerate(parents):
            if b not in continued:
                self._finish(parent, "abort")
        for child, beam in zip(children, running, strict=True):
            child.token_ids.append(beam.token)
            if child.grammar is not None:  # forked above with its parent's matcher
                child.grammar.accept(beam.token)
        beams.seqs = children
        return []

    def _finish_beams(self, request_id: str) -> list[RequestOutput]:
        beams = self.beams.pop(request_id)
        for seq in beams.seqs:
            self._finish(seq, "length")
        first = self._requests.pop(request_id)
        best = beams.search.best()
        outputs = []
        for i, hypothesis in enumerate(best):
            tokens = list(hypothesis.token_ids)
            detokenizer = self._detokenizer(
                first.token_ids[: first.num_prompt_tokens], first.params
            )
            text = ""
            if detokenizer is not None:
                text = detokenizer.add(tokens[:-1] if hypothesis.stopped else tokens)
                text += detokenizer.flush()
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=tokens,
                    text_delta=text,
                    finished=True,
                    finish_reason="stop" if hypothesis.stopped else "length",
                    num_prompt_tokens=first.num_prompt_tokens,
                    num_cached_tokens=first.num_cached_tokens,
                    index=i,
                    open_choices=len(best) - 1 - i,
                    cumulative_logprob=hypothesis.cumulative_logprob,
                    score=hypothesis.score,
                )
            )
        return outputs
