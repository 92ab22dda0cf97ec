"""Cost-aware proposal length (spec_payoff.best_length): the engine drafts as many tokens per
sequence as pay best by the measured step cost of each draft count and the measured acceptance
per draft position, and greedy output stays the plain greedy output.

As in test_switch_off.py the engine, model and verification are real; only the step
clock is a counter advanced by a cost model (each step 1, plus `per_draft` per draft
position), so the choice is deterministic."""

from __future__ import annotations

import pytest

from pdserve.engine.speculation.payoff import DraftAcceptance, StepTimes, best_length
from tests.engine.speculation.test_switch_off import GREEDY, Oracle, timed_engine
from tests.engine.speculation.test_switch_off import case as case  # noqa: F401  (fixture)


def test_engine_drafts_the_length_that_pays_best(tiny_dir, case):
    prompt, expected = case
    # The first 2 of 4 drafts are right and each draft position costs 0.3 of a plain step:
    # 2 drafts emit 3 tokens for 1.6 steps (1.88 per step), 4 drafts 3 tokens for 2.2 (1.36),
    # 1 draft 2 tokens for 1.3 (1.54), 3 drafts 3 for 1.9 (1.58).
    engine = timed_engine(tiny_dir, Oracle(expected, len(prompt), 2), per_draft=0.3)
    assert engine.generate([prompt], GREEDY)[0] == expected
    stats = engine.stats()
    # Always k = 4 (the old behaviour) would draft 4 per verification; the lengths tried
    # while their costs are measured (3 steps each) leave the mean near 2.
    drafted_per_verify = stats["spec_draft_tokens"] / stats["spec_verify_steps"]
    assert drafted_per_verify < 2.4, stats
    assert stats["spec_paused"] == 0, stats


def test_best_length_maximizes_tokens_per_second():
    def costs(table):
        return lambda j: table.get(j)

    rates = [0.9] * 4
    assert best_length(4, rates, costs({})) == 4  # plain unmeasured: the switch-off's call
    assert best_length(4, rates, costs({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})) == 4
    # Every length exactly at break-even: none pays, full proposals (the switch-off pauses).
    assert best_length(4, [1.0] * 4, costs({j: 1.0 + j for j in range(5)})) == 4
    # Cheap first draft, expensive fourth; later drafts rarely right: 1 draft.
    assert best_length(4, [0.9, 0.5, 0.5, 0.5], costs({0: 1.0, 1: 1.0, 4: 3.0})) == 1
    # Longer lengths unmeasured: taken as costly as the longest measured, so tried.
    assert best_length(4, rates, costs({0: 1.0, 1: 1.5})) == 4


def test_draft_acceptance_counts_positions_reached():
    acceptance = DraftAcceptance(4)
    assert acceptance.rates() == [0.5] * 4  # the uniform prior
    acceptance.record(drafted=4, accepted=2)  # 1, 2 accepted, 3 rejected, 4 never judged
    assert acceptance.rates() == pytest.approx([2 / 3, 2 / 3, 1 / 3, 0.5])
    acceptance.record(drafted=1, accepted=1)  # a probe's one draft, accepted
    assert acceptance.rates()[0] == pytest.approx((0.95 + 1 + 1) / (0.95 + 1 + 2))


def test_step_cost_counts_from_three_steps():
    now = [0.0]
    times = StepTimes(window=8, clock=lambda: now[0])
    for seconds in (2.0, 3.0, 9.0):
        times.start()
        times.decoding(1)
        now[0] += seconds
        times.finish(1, speculative=True, drafts=2)
        if seconds != 9.0:
            assert times.cost(1, 2) is None
    assert times.cost(1, 2) == 3.0  # the median: one slow step does not move it
    assert times.cost(1, 0) is None and times.cost(2, 2) is None
