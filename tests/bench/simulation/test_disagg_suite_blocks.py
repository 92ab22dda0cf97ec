"""The suite's samples in blocks of a probe's size: every probe, a prefix of the sample, offers
the whole workload (its phases, its sessions' every turn), not the start of one long trace."""

from __future__ import annotations

from pdserve.bench.simulation.disagg_suite.suite import Setting, SuiteOptions, cell_sample
from pdserve.bench.simulation.disagg_suite.workloads import AGENTIC_TURNS, suite_sample

PHASE_ORDER = ["chat", "code", "rag", "agentic"]


def _kind(r) -> str:
    return r.tag.split(":")[0]


def _phase_order(block: list) -> list[str]:
    """The kinds of `block`'s quarters, each asserted to hold one kind."""
    quarter = len(block) // 4
    kinds = []
    for q in range(4):
        in_quarter = {_kind(r) for r in block[q * quarter : (q + 1) * quarter]}
        assert len(in_quarter) == 1, in_quarter
        kinds += in_quarter
    return kinds


def test_every_phases_block_holds_the_four_phases_in_order() -> None:
    sample = suite_sample("phases", 1000, seed=3, block=200)
    blocks = [sample[b : b + 200] for b in range(0, 1000, 200)]
    assert [_phase_order(block) for block in blocks] == [PHASE_ORDER] * 5


def _sessions(block: list) -> dict[str, list[list[int]]]:
    by_session: dict[str, list[list[int]]] = {}
    for r in block:
        if _kind(r) == "agentic":
            by_session.setdefault(r.tag, []).append(list(r.prompt))
    return by_session


def _assert_whole_sessions(block: list) -> None:
    """Every session of `block` has every turn, each turn's prompt extending the one before."""
    sessions = _sessions(block)
    assert sessions
    for turns in sessions.values():
        assert len(turns) == AGENTIC_TURNS
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert len(later) > len(earlier) and later[: len(earlier)] == earlier


def test_every_agentic_block_holds_whole_sessions_of_its_own() -> None:
    block = 20 * AGENTIC_TURNS
    sample = suite_sample("agentic", 3 * block, block=block)
    blocks = [sample[b : b + block] for b in range(0, len(sample), block)]
    for part in blocks:
        _assert_whole_sessions(part)
        assert len(_sessions(part)) == 20
        # In rounds: every session's first turn before any session's second.
        first_turns = {r.tag: i for i, r in reversed(list(enumerate(part)))}
        assert max(first_turns.values()) < 20
        # Sessions share system prompts (8 sessions each): some share their first 1024 tokens.
        openings = [turns[0][:1024] for turns in _sessions(part).values()]
        assert len({tuple(o) for o in openings}) < len(openings)
    tags = [set(_sessions(part)) for part in blocks]
    assert not (tags[0] & tags[1]) and not (tags[1] & tags[2]) and not (tags[0] & tags[2])


def test_every_mix_block_holds_every_kind_and_whole_sessions() -> None:
    block = 4 * 10 * AGENTIC_TURNS
    sample = suite_sample("mix", 2 * block, block=block)
    for part in (sample[:block], sample[block:]):
        assert {_kind(r) for r in part} == set(PHASE_ORDER)
        _assert_whole_sessions(part)


def test_a_blocked_sample_is_deterministic_with_indices_and_arrivals_over_the_whole() -> None:
    first = suite_sample("agentic", 400, seed=5, block=160)
    again = suite_sample("agentic", 400, seed=5, block=160)
    key = [(r.index, list(r.prompt), r.output_len, r.unit_arrival, r.tag) for r in first]
    assert key == [(r.index, list(r.prompt), r.output_len, r.unit_arrival, r.tag) for r in again]
    assert [r.index for r in first] == list(range(400))
    # One unit-rate Poisson process over the whole sample, the same whatever the blocks.
    unblocked = suite_sample("agentic", 400, seed=5)
    assert [r.unit_arrival for r in first] == [r.unit_arrival for r in unblocked]
    # The last block is cut to the sample's size: its first 80 requests, first rounds.
    assert len(_sessions(first[320:])) == 20


def test_the_suite_cell_sample_repeats_its_phases_every_shortest_probe() -> None:
    # 70B: 4 workers, the smallest simulated replica has 2, so the shortest probe is 2 x 40.
    options = SuiteOptions((Setting(2048, 256),), requests_per_worker=40)
    sample = cell_sample("70b", "phases", options)
    assert len(sample) > 80 * 10
    assert [_phase_order(sample[b : b + 80]) for b in range(0, 800, 80)] == [PHASE_ORDER] * 10
