"""BeamSearch: the state of one beam-search request, step by step (no torch).

The rule is transformers' `generate(num_beams=k, do_sample=False)` (generation/utils.py,
`_beam_search`), so the returned beams and scores are the same:
- each step, every running beam offers its top K = max(2, 1 + number of stop ids) * k next
  tokens by log-probability; a candidate's total is its beam's total plus that log-probability,
  and the best K totals over all beams are kept, best first;
- a candidate "hits" when its token is a stop id or it reaches max_tokens; the best k
  candidates that do not hit are the next running beams;
- among the first k candidates, those that hit become finished hypotheses scored
  total / generated_length ** length_penalty (the stop token counted), unless early_stopping
  and k hypotheses are already finished, or no running beam can improve on them anymore;
  only the best k hypotheses are kept;
- the search ends when nothing can improve (once k hypotheses are finished, the best running
  total over the current length, to the length_penalty, is no better than the worst finished
  score), when early_stopping and k hypotheses are finished, or when every candidate hit.
The engine runs the beams as forked sequences inside the batch (engine.py); this module only
decides which beams live on and which end.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.sequence import Sequence as EngineSequence

# transformers' score of "no hypothesis here": below any real total.
_NO_SCORE = -1.0e9


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens (the stop token included), their summed
    log-probability, and its score (cumulative_logprob / len(token_ids) ** length_penalty)."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    stopped: bool  # ended by a stop token (else by max_tokens)


@dataclass(frozen=True)
class NextBeam:
    """A running beam after a step: `parent` (its index among the running beams before the
    step) extended by `token`, with `total`, its cumulative log-probability."""

    parent: int
    token: int
    total: float


class BeamSearch:
    def __init__(self, params: SamplingParams, stop_ids: Collection[int], max_tokens: int) -> None:
        """`max_tokens`: generated tokens at which every beam ends (max_tokens, or less where
        the context is shorter)."""
        self.width = params.beam_width
        self.num_return = params.n
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.stop_ids = frozenset(stop_ids)
        self.max_tokens = max_tokens
        self.candidates_per_beam = max(2, 1 + len(self.stop_ids)) * self.width
        self.totals = [0.0]  # the running beams' cumulative log-probabilities, best first
        self.outputs: list[tuple[int, ...]] = [()]  # the running beams' generated tokens
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.num_generated = 0
        self.improvable = True
        self.done = False

    def step(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> list[NextBeam]:
        """Advances one token. `candidates[b]`: running beam b's best (token, log-probability)
        pairs, at least `candidates_per_beam` of them (fewer only if the vocabulary is
        smaller). Returns the next running beams, best first (empty once `done`)."""
        assert not self.done and len(candidates) == len(self.totals)
        scored = [
            (self.totals[b] + logprob, b, token)
            for b, offered in enumerate(candidates)
            for token, logprob in offered
        ]
        # Best totals first; equal totals in beam order, then in each beam's offer order.
        order = sorted(range(len(scored)), key=lambda i: -scored[i][0])
        top = [scored[i] for i in order[: self.candidates_per_beam]]
        length = self.num_generated + 1
        hits = [token in self.stop_ids or length >= self.max_tokens for _, _, token in top]
        self._add_finished(top[: self.width], hits[: self.width], length)
        running = [
            NextBeam(parent, token, total)
            for (total, parent, token), hit in zip(top, hits, strict=True)
            if not hit
        ][: self.width]
        self.outputs = [self.outputs[beam.parent] + (beam.token,) for beam in running]
        self.totals = [beam.total for beam in running]
        self.num_generated = length
        self._update_improvable()
        self.done = (
            not running
            or all(hits)
            or not self.improvable
            or (self.early_stopping and len(self.finished) == self.width)
        )
        return [] if self.done else running

    def best(self) -> list[Hypothesis]:
        """The `n` best finished hypotheses, best first."""
        return self.finished[: self.num_return]

    def _add_finished(
        self, top: list[tuple[float, int, int]], hits: list[bool], length: int
    ) -> None:
        full = len(self.finished) == self.width
        if (self.early_stopping and full) or not self.improvable:
            return
        new = [
            Hypothesis(
                self.outputs[parent] + (token,),
                total,
                total / (length**self.length_penalty),
                token in self.stop_ids,
            )
            for (total, parent, token), hit in zip(top, hits, strict=True)
            if hit
        ]
        # Stable: on equal scores the earlier hypothesis stays ahead, as in transformers.
        merged = sorted(self.finished + new, key=lambda h: -h.score)
        self.finished = merged[: self.width]

    def _update_improvable(self) -> None:
        """transformers' early-stop heuristic: once `width` hypotheses are finished, the best
        running beam, scored at the current length, must beat the worst of them."""
        if not self.improvable or len(self.finished) < self.width:
            return
        best_running = self.totals[0] if self.totals else _NO_SCORE
        best_possible = best_running / (self.num_generated**self.length_penalty)
        self.improvable = best_possible > self.finished[-1].score


@dataclass
class BeamRequest:
    """A beam-search request: its search, its running beams (aligned with the search's), and
    the candidates each beam offered this round (by id(), sequences compare by value)."""

    search: BeamSearch
    seqs: list[EngineSequence]
    offers: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
