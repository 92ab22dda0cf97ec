"""The switch-off decides on measured cost, not acceptance alone (payoff.py): speculation
that accepts little but verifies almost for free keeps going; speculation that accepts much but
costs more than it emits pauses; greedy output stays the plain greedy output either way.

The engine, the model and the verification are the real ones; only the step clock is a
counter the test advances by a cost model of its choosing (each step costs 1, plus
`per_draft` per draft position scheduled), so the decisions are deterministic."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.speculation.ngram_proposer import NgramProposer
from pdserve.engine.speculation.payoff import CLEAR_LOSS, StepTimes
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from tests.engine.conftest import random_prompts

TOKENS = 200
GREEDY = SamplingParams(max_tokens=TOKENS, ignore_eos=True)


class Oracle(NgramProposer):
    """Proposes k tokens of which the first `right` are the plain greedy continuation and the
    rest are wrong: acceptance right / k at every verification."""

    def __init__(self, expected: list[int], prompt_len: int, right: int) -> None:
        super().__init__()
        self.expected, self.prompt_len, self.right = expected, prompt_len, right

    def propose(self, seqs, k):
        self._num_proposed = len(seqs)
        out = []
        for seq in seqs:
            done = seq.num_tokens - self.prompt_len
            truth = self.expected[done : done + k]
            out.append(truth[: self.right] + [t ^ 1 for t in truth[self.right :]])
        return out


def timed_engine(model_dir, proposer, per_draft: float) -> LLMEngine:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=128, speculative=spec)
    )
    speculation = engine._speculation  # noqa: SLF001
    speculation.proposer = proposer
    now = [0.0]
    speculation.times.clock = lambda: now[0]
    execute = engine.executor.execute

    def costed(batch, started):
        now[0] += 1.0 + per_draft * (sum(batch.num_tokens) - len(batch.seqs))
        return execute(batch, started)

    engine.executor.execute = costed
    return engine


@pytest.fixture(scope="module")
def case(tiny_dir):
    prompt = random_prompts([12], seed=7)[0]
    plain = LLMEngine(EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=128))
    return prompt, plain.generate([prompt], GREEDY)[0]


def test_low_acceptance_that_pays_keeps_speculating(tiny_dir, case):
    prompt, expected = case
    # 1 of 4 drafts right (acceptance 0.25, under min_acceptance 0.4), verification free:
    # two tokens per step for the price of one.
    engine = timed_engine(tiny_dir, Oracle(expected, len(prompt), 1), per_draft=0.0)
    assert engine.generate([prompt], GREEDY)[0] == expected
    stats = engine.stats()
    assert stats["spec_paused"] == 0, stats
    assert stats["spec_accepted_tokens"] < 0.4 * stats["spec_draft_tokens"], stats
    # The acceptance rate pauses it at first (no plain step timed yet); the first probe,
    # timed against the plain steps of the pause, resumes it for good: ~(200 - 40) / 2.
    assert stats["spec_verify_steps"] > 60, stats


def test_high_acceptance_that_costs_more_pauses(tiny_dir, case):
    prompt, expected = case
    # 3 of 4 right (acceptance 0.75) but each draft position costs a plain step: 4 tokens
    # for the price of 5.
    engine = timed_engine(tiny_dir, Oracle(expected, len(prompt), 3), per_draft=1.0)
    params = dataclasses.replace(GREEDY, max_tokens=150)  # ends in the second pause
    assert engine.generate([prompt], params)[0] == expected[:150]
    stats = engine.stats()
    assert stats["spec_paused"] == 1, stats
    assert stats["spec_accepted_tokens"] >= 0.7 * stats["spec_draft_tokens"], stats
    # 8 steps before a plain step is timed, 8 judged ones, a pause of 32 steps, a probe
    # (accepted), 8 judged ones, a pause of 64 steps: 25 verifications where never pausing
    # takes 37.
    assert stats["spec_verify_steps"] <= 27, stats


def test_step_times_speedup_is_plain_seconds_over_speculative_seconds():
    now = [0.0]
    times = StepTimes(window=2, clock=lambda: now[0], sequences=4)

    def step(batch: int, seconds: float, accepted: int, speculative: bool) -> None:
        times.start()
        times.decoding(batch)
        now[0] += seconds
        times.finish(accepted, speculative)

    step(2, 3.0, 2, True)  # no plain time for batch 2 yet: not judged
    assert times.speedup() is None and not times.judging
    assert not times.wants_plain(2)
    step(2, 3.0, 2, True)
    assert times.wants_plain(2)  # a window of unjudged steps: time a plain one
    # The first plain step of a batch size may be a warm-up (a CUDA graph captured): its cost
    # is the median of MIN_COST_SAMPLES plain steps, run back to back.
    step(2, 100.0, 0, False)
    assert not times.judging and times.wants_plain(2)
    step(2, 1.0, 0, False)
    assert not times.judging and times.wants_plain(2)
    step(2, 1.0, 0, False)
    assert times.judging and not times.wants_plain(2)
    step(2, 3.0, 2, True)  # 4 tokens = 2 plain steps of 1 s, in 3 s
    step(2, 1.5, 1, True)  # 3 tokens = 1.5 plain steps, in 1.5 s
    assert times.speedup() == pytest.approx((2.0 + 1.5) / (3.0 + 1.5))
    times.start()  # a step with a prefill chunk is not timed
    now[0] += 100.0
    times.finish(0, False)
    assert times.speedup() == pytest.approx((2.0 + 1.5) / (3.0 + 1.5))
    times.clear()
    assert times.speedup() is None


def test_min_acceptance_zero_never_pauses(tiny_dir, case):
    prompt, expected = case
    engine = timed_engine(tiny_dir, Oracle(expected, len(prompt), 0), per_draft=1.0)
    engine._speculation.config = dataclasses.replace(  # noqa: SLF001
        engine.config.speculative, min_acceptance=0.0
    )
    assert engine.generate([prompt], GREEDY)[0] == expected
    stats = engine.stats()
    assert stats["spec_paused"] == 0 and stats["spec_verify_steps"] >= TOKENS - 2, stats


def test_the_judged_window_covers_enough_sequence_steps_unless_the_loss_is_clear():
    """At batch 1 a window of 8 steps holds 8 accept-or-reject outcomes: too few to judge a
    speculation that pays 20% in the mean. The judged window reaches back to 32 sequence-steps;
    a loss below CLEAR_LOSS over the last 8 is judged at once."""
    now = [0.0]
    times = StepTimes(window=8, clock=lambda: now[0], sequences=32)

    def step(batch: int, seconds: float, accepted: int, speculative: bool = True) -> None:
        times.start()
        times.decoding(batch)
        now[0] += seconds
        times.finish(accepted, speculative, drafts=1 if speculative else 0)

    for _ in range(3):
        step(1, 1.0, 0, speculative=False)  # plain: 1 s a token
    # k = 1 at 1.25 s a step: 2 tokens pay 1.6x, 1 token costs 0.8x.
    for accepted in [1, 0, 1, 1, 0, 1, 0, 1]:
        step(1, 1.25, accepted)
    assert times.speedup() is None  # 8 steps, 8 sequence-steps: not judged yet
    assert times.recent_speedup() == pytest.approx(13 / 10)
    for _ in range(8):  # an unlucky run: nothing accepted
        step(1, 1.25, 0)
    assert times.speedup() is None
    assert times.recent_speedup() == pytest.approx(0.8)  # below CLEAR_LOSS: a loss
    for _ in range(16):
        step(1, 1.25, 1)
    assert times.speedup() == pytest.approx((13 + 8 + 32) / 40)  # the last 32 steps
    step(1, 1.25, 1)  # the window slides: the oldest step (1 accepted) leaves
    assert times.speedup() == pytest.approx((11 + 8 + 34) / 40)
    for _ in range(4):  # at batch 8, 8 steps cover 64 sequence-steps: the window is 8 steps
        step(8, 1.0, 0, speculative=False)
    for _ in range(8):
        step(8, 2.0, 8)
    assert times.speedup() == pytest.approx(1.0)
    assert CLEAR_LOSS < 1
