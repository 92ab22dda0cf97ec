"""The engine's side of speculative decoding: which sequences get drafts, fitting the drafts to
what the scheduler granted, the counters, and switching itself off when it does not pay.

A step with speculation reads: `propose(running)` appends up to k proposed tokens to each
running decode sequence that may speculate (`Sequence.num_draft_tokens`), so the scheduler
schedules 1 + d tokens for it within its budget and max_num_seqs; `fit(drafted, batch)` then
takes the drafts off the sequences that were not scheduled or were preempted, and trims them to
what was scheduled; the executor verifies (verification.py) and the engine rolls back
(LLMEngine._accept_verified). The sim executor never speculates: the engine builds no
`Speculation` for `kind == "sim"`.

Self switch-off (docs/decoding.md, "Speculative decoding"): speculation pays when the tokens a
verify step emits outweigh what it costs over a plain step, and both are measured
(payoff.py: the engine's decode-only steps timed with and without drafts, per batch size).
Once the last SPEC_STEPS speculative steps (at least JUDGED_SEQUENCES sequence-steps) could be
timed against plain steps of their batch size, proposing pauses when their measured speedup is
below 1 (sooner, below CLEAR_LOSS over SPEC_STEPS steps). Until then the acceptance rate
decides: below `min_acceptance` over the last `acceptance_window` drafted tokens, proposing
pauses, unless the speculative steps timed so far pay; and after SPEC_STEPS speculative steps
that could not be judged, one step runs plain to be timed. While paused, after a wait one step
proposes one token for one sequence (a probe: one draft forward and one more position in the
batch, not k for the whole batch); speculation resumes if that token is accepted, or if first
drafts were accepted at least `min_acceptance` of the time recently (spec_payoff's
DraftAcceptance, the probe included), and the next window's measured speedup judges it.
Every pause and every failed probe doubles the next wait (from `probe_interval` steps up to
MAX_BACKOFF times that), and a window that pays resets it, so a workload where speculation
does not pay costs a few steps, then almost nothing.
`min_acceptance == 0` turns the switch-off off.
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import ScheduledBatch, Verified
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculation.payoff import (
    CLEAR_LOSS,
    DraftAcceptance,
    StepTimes,
    best_length,
    step_clock,
)
from pdserve.engine.speculation.proposer import Proposer, make_proposer
from pdserve.engine_config import EngineConfig, SpeculativeConfig


def may_speculate(seq: Sequence) -> bool:
    """Whether this sequence's next tokens may be proposed and verified: a running decode of a
    request that allows it and whose tokens depend on nothing but the final logits."""
    params = seq.params
    return (
        seq.status == SequenceStatus.RUNNING
        and params.speculative
        and not seq.prefill_only
        and not params.beam_search
        and params.dola_layers is None
        and not params.sled
        and params.repetition_penalty == 1.0
        and not seq.pending_forks
        and seq.num_output_tokens >= 1
        and seq.num_computed_tokens == seq.num_tokens - 1
    )


def make_speculation(
    config: EngineConfig, block_manager: BlockManager, max_model_len: int
) -> Speculation | None:
    """The engine's speculation, or None: when off, and always with the sim executor."""
    if not config.speculative.enabled or config.kind == "sim":
        return None
    proposer = make_proposer(config, block_manager.num_blocks)
    if proposer is None:
        return None
    times = StepTimes(SPEC_STEPS, step_clock(config.device))
    return Speculation(config.speculative, proposer, block_manager, max_model_len, times)


def speculation_stats(speculation: Speculation | None) -> dict[str, int]:
    """The engine's speculation counters (LLMEngine.stats()); zeros when it has none."""
    return speculation.stats() if speculation else dict.fromkeys(STAT_NAMES, 0)


class Speculation:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        block_manager: BlockManager,
        max_model_len: int,
        times: StepTimes | None = None,
    ) -> None:
        self.config = config
        self.times = times or StepTimes(SPEC_STEPS, step_clock("cpu"))
        self.proposer = proposer
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.verify_steps = 0
        self._window: deque[tuple[int, int]] = deque()  # (drafted, accepted) per verification
        self._window_drafted = 0
        self._window_accepted = 0
        self._step = 0
        self._paused_until: int | None = None  # the next probe step while paused
        self._probe_gap = config.probe_interval
        self._step_drafted = 0
        self._step_accepted = 0
        self._step_most = 0  # most drafts one sequence verified this step
        self.acceptance = DraftAcceptance(config.num_speculative_tokens)
        self._probes = 0  # probes so far: which running sequence the next one drafts for

    @property
    def paused(self) -> bool:
        return self._paused_until is not None

    # ---- before the step runs -----------------------------------------------------------
    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Appends drafts to the running sequences that may speculate; returns those that got
        at least one."""
        self._step += 1
        self.times.start()
        # Which steps verify never changes a seeded request's tokens (the coupled draw,
        # verification.py), so measured time may decide.
        timed = self.config.min_acceptance > 0
        probing = self._paused_until is not None
        if probing and self._step < self._paused_until:
            return []
        if timed and not probing and self.times.wants_plain(len(running)):
            return []  # a plain step of this batch size, timed to judge the drafted ones
        k = self.config.num_speculative_tokens
        if timed and not probing:  # as many drafts as pay best, by measured cost and acceptance
            batch = len(running)
            k = best_length(k, self.acceptance.rates(), lambda j: self.times.cost(batch, j))
        candidates = [s for s in running if may_speculate(s) and self._room(s) > 0]
        if probing and candidates:  # one token of one sequence, a different one each probe
            candidates = [candidates[self._probes % len(candidates)]]
            self._probes += 1
            k = 1
        if self.proposer.writes_kv:
            grow = self.block_manager.ensure_blocks
            candidates = [s for s in candidates if grow(s, s.num_tokens + k - 1)]
        if not candidates:
            return []
        proposals = self.proposer.propose(candidates, k)
        probs = self.proposer.draft_probs()
        drafted = []
        for seq, tokens, q in zip(candidates, proposals, probs, strict=True):
            tokens = tokens[: min(k, self._room(seq))]
            if seq.grammar is not None:  # drafts the grammar refuses are not worth verifying
                tokens = seq.grammar.allowed_prefix(tokens)
            if not tokens:
                self.block_manager.truncate(seq, seq.num_tokens)
                continue
            seq.token_ids += tokens
            seq.num_draft_tokens = len(tokens)
            seq.draft_probs = None if q is None else q[: len(tokens)]
            drafted.append(seq)
        return drafted

    def _room(self, seq: Sequence) -> int:
        """Most drafts worth verifying: a verification emits up to d + 1 tokens, within
        max_tokens and max_model_len."""
        left = seq.params.max_tokens - seq.num_output_tokens
        return min(left, self.max_model_len - seq.num_tokens) - 1

    def fit(self, drafted: list[Sequence], batch: ScheduledBatch) -> None:
        """Takes the drafts off the sequences the scheduler did not run (or preempted) and
        trims the others' to the tokens it scheduled (1 + the drafts kept)."""
        scheduled = {id(seq): n for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)}
        for seq in drafted:
            n = scheduled.get(id(seq), 0) if seq.status == SequenceStatus.RUNNING else 0
            keep = max(n - 1, 0)
            if keep < seq.num_draft_tokens:
                del seq.token_ids[seq.num_tokens - seq.num_draft_tokens + keep :]
                seq.num_draft_tokens = keep
                if seq.draft_probs is not None:
                    seq.draft_probs = seq.draft_probs[:keep] if keep else None
            if seq.status == SequenceStatus.RUNNING:  # blocks grown for drafts it dropped
                self.block_manager.truncate(seq, seq.num_tokens)
        for seq in batch.preempted:
            self.proposer.forget(seq)
        if batch.seqs and not batch.fork_samples and all(_decodes(s, n) for s, n in _pairs(batch)):
            self.times.decoding(len(batch.seqs))  # a step whose cost is the decode's: timed

    # ---- after the step -----------------------------------------------------------------
    def record(self, drafted: int, accepted: int) -> None:
        """One sequence's verification: `accepted` of its `drafted` tokens."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_steps += 1
        self._step_drafted += drafted
        self._step_accepted += accepted
        self._step_most = max(self._step_most, drafted)
        self.acceptance.record(drafted, accepted)
        self._window.append((drafted, accepted))
        self._window_drafted += drafted
        self._window_accepted += accepted
        while self._window_drafted - self._window[0][0] >= self.config.acceptance_window:
            old_drafted, old_accepted = self._window.popleft()
            self._window_drafted -= old_drafted
            self._window_accepted -= old_accepted

    def end_step(self) -> None:
        """Times the step, then pauses or resumes proposing on what was measured."""
        drafted, accepted = self._step_drafted, self._step_accepted
        most, self._step_most = self._step_most, 0
        self._step_drafted = self._step_accepted = 0
        self.times.finish(accepted, speculative=drafted > 0, drafts=most)
        threshold = self.config.min_acceptance
        if threshold <= 0:
            return
        if self._paused_until is not None:
            if self._step < self._paused_until or not drafted:
                return  # not a probe, or a probe with nothing to verify: probe again
            # The probe's one token, or the recent acceptance of first drafts it joins, says
            # whether proposals can be right again (one token alone is a coin toss where half
            # the drafts are right); whether they pay is for the next window's measured
            # speedup (one step's time is too noisy).
            self._clear_window()
            if accepted >= threshold * drafted or self.acceptance.rates()[0] >= threshold:
                self._paused_until = None
            else:
                self._pause()
            return
        judged = self.times.judging
        speedup = self.times.speedup() if judged else None
        if speedup is not None:  # a full window measured: the speedup decides
            if speedup < 1:
                self._pause()
            else:
                self._probe_gap = self.config.probe_interval
            return
        recent = self.times.recent_speedup() if judged else None
        if recent is not None and recent < CLEAR_LOSS:  # too clear a loss to wait for the window
            self._pause()
            return
        if self._window_drafted < self.config.acceptance_window:
            return
        if self._window_accepted >= threshold * self._window_drafted:
            self._probe_gap = self.config.probe_interval
            return
        # Low acceptance before the window is measured: pause, unless the steps timed so far
        # show it paying anyway (verification cheap enough for the few tokens accepted).
        so_far = self.times.speedup(partial=True) if judged else None
        if so_far is None or so_far < 1:
            self._pause()

    def _pause(self) -> None:
        """Stops proposing for the current wait, and doubles the next one."""
        self._paused_until = self._step + self._probe_gap
        self._probe_gap = min(2 * self._probe_gap, MAX_BACKOFF * self.config.probe_interval)
        self._clear_window()

    def _clear_window(self) -> None:
        self._window.clear()
        self._window_drafted = self._window_accepted = 0
        self.times.clear()

    def roll_back(self, seq: Sequence, verified: Verified) -> None:
        """After the verify forward computed seq's last token and drafts: keeps the KV of the
        accepted drafts, frees the blocks past them, caches the full blocks now final, and
        takes the drafts off `token_ids` (the engine appends `verified.token_ids`, whose last
        token is not computed yet)."""
        drafted, accepted = seq.num_draft_tokens, verified.num_accepted
        self.record(drafted, accepted)
        base = seq.num_tokens - drafted
        del seq.token_ids[base + accepted :]
        seq.num_draft_tokens = 0
        seq.draft_probs = None
        seq.num_computed_tokens = base + accepted
        self.block_manager.truncate(seq, base + accepted + 1)
        self.block_manager.cache_full_blocks(seq)
        del seq.token_ids[base:]

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.proposer.copy_blocks(copies)

    def stats(self) -> dict[str, int]:
        values = (self.draft_tokens, self.accepted_tokens, self.verify_steps, int(self.paused))
        return dict(zip(STAT_NAMES, values, strict=True))


MAX_BACKOFF = 16  # the longest pause between probes, in probe intervals
SPEC_STEPS = 8  # speculative steps whose measured speedup decides whether speculation pays


def _pairs(batch: ScheduledBatch):
    return zip(batch.seqs, batch.num_tokens, strict=True)


def _decodes(seq: Sequence, n: int) -> bool:
    """Whether seq's n scheduled tokens are its next token and its drafts (no prompt chunk)."""
    return n == 1 + seq.num_draft_tokens and seq.num_computed_tokens >= seq.num_prompt_tokens


# LLMEngine.stats() keys (0 when speculation is off): drafted tokens verified, drafts accepted,
# sequence-steps that verified drafts, and whether the self switch-off holds now.
STAT_NAMES = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps", "spec_paused")
