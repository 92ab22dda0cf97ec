"""A sim step's sleep wakes late; what it overshoots by is owed by the next step while the worker
goes straight on (issue 49 point 0: without it a fidelity run's sim steps took 16 % longer than
modelled). Driven on an injected clock whose sleeps always wake OVERSHOOT late: deterministic."""

from __future__ import annotations

import json

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.sim.executor import SimExecutor
from pdserve.sim.timing import Chunk, LinearTiming, StepWork
from tests.sim.conftest import LLAMA_8B_SHAPE

COEFFICIENTS = dict(step_s=0.002, prefill_token_s=1e-5, decode_seq_s=1e-4, context_token_s=0.0)
OVERSHOOT = 0.0003  # seconds every sleep wakes late


class LateWakingClock:
    """A clock that moves only when slept on, each sleep OVERSHOOT longer than asked."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + OVERSHOOT


def _executor(tmp_path, clock: LateWakingClock) -> SimExecutor:
    profile = tmp_path / "mean.json"
    profile.write_text(json.dumps({"kind": "linear", **COEFFICIENTS}))
    return SimExecutor(
        LLAMA_8B_SHAPE,
        num_blocks=64,
        block_size=4,
        dtype="bfloat16",
        profile=str(profile),
        avoid_token_ids=set(),
        sleep=clock.sleep,
        clock=clock,
    )


def _decode_step(executor: SimExecutor, clock: LateWakingClock, seq: Sequence) -> float:
    """Runs one decode step of `seq` started now (no Python work between steps on this clock);
    its seconds."""
    batch = ScheduledBatch()
    batch.add(seq, 1)
    started = clock.now
    _, tokens, _ = executor.execute(batch, started)
    seq.num_computed_tokens += 1
    seq.token_ids.append(tokens[0])
    return clock.now - started


def _sequence(request_id: str) -> Sequence:
    prompt = list(range(10, 18))
    seq = Sequence(request_id, [*prompt, 20], len(prompt), SamplingParams(max_tokens=64), 0)
    seq.num_computed_tokens = len(prompt)  # prefilled, its first token out: the next decodes
    return seq


def test_a_busy_workers_steps_last_the_modelled_total_not_one_late_wake_up_per_step(tmp_path):
    clock = LateWakingClock()
    executor = _executor(tmp_path, clock)
    seq = _sequence("a")
    steps = [_decode_step(executor, clock, seq) for _ in range(20)]
    timing = LinearTiming(**COEFFICIENTS)
    modelled = [timing.step_seconds(StepWork.of([Chunk(8 + i, 1, True)], 1)) for i in range(20)]
    # The first step wakes late; each next one is due that much earlier and wakes as late: the
    # worker's steps end on the modelled schedule, a single overshoot behind.
    assert steps[0] == pytest.approx(modelled[0] + OVERSHOOT)
    assert steps[1:] == pytest.approx(modelled[1:])
    assert sum(steps) == pytest.approx(sum(modelled) + OVERSHOOT)
    stats = executor.stats()
    assert stats["sim_measured_seconds"] == pytest.approx(sum(modelled) + OVERSHOOT)
    assert stats["sim_modelled_seconds"] == pytest.approx(sum(modelled))
    assert stats["sim_overrun_steps"] == 0  # repaying is not overrunning


def test_the_overshoot_is_not_owed_across_a_step_of_other_requests(tmp_path):
    clock = LateWakingClock()
    executor = _executor(tmp_path, clock)
    first, other = _sequence("a"), _sequence("b")
    _decode_step(executor, clock, first)
    clock.now += 1.0  # idle: the next step starts when a new request arrives
    step = _decode_step(executor, clock, other)
    timing = LinearTiming(**COEFFICIENTS)
    # Nobody waited on the first step's overshoot: the new one sleeps its whole modelled time.
    assert step == pytest.approx(
        timing.step_seconds(StepWork.of([Chunk(8, 1, True)], 1)) + OVERSHOOT
    )
    assert clock.sleeps[-1] == pytest.approx(
        timing.step_seconds(StepWork.of([Chunk(8, 1, True)], 1))
    )


def test_a_step_owing_more_than_it_lasts_does_not_sleep_and_owes_the_rest(tmp_path):
    clock = LateWakingClock()
    executor = _executor(tmp_path, clock)
    seq = _sequence("a")
    batch = ScheduledBatch()
    batch.add(seq, 1)
    modelled = LinearTiming(**COEFFICIENTS).step_seconds(StepWork.of([Chunk(8, 1, True)], 1))
    clock.now = 3 * modelled  # Python work (a busy core) ran past the step's modelled end
    executor.execute(batch, 0.0)
    seq.num_computed_tokens += 1
    seq.token_ids.append(5)
    sleeps = len(clock.sleeps)
    steps = [_decode_step(executor, clock, seq) for _ in range(3)]
    # 2 modelled steps owed: the next two steps do not sleep, the third sleeps its full time.
    assert len(clock.sleeps) == sleeps + 1 and steps[:2] == [0.0, 0.0]
    # Overrun: the late one; the two repaying it kept inside their own modelled time.
    assert executor.stats()["sim_overrun_steps"] == 1
