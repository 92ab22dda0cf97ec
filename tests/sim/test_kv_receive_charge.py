"""The KV a decode worker receives costs its core (issue 49 point 0: on a CPU the real gap
between decode steps grew with the KV arriving). Calibration fits a cost per received byte from
the gaps and the bytes written before each step, takes what it explains off the replayed gaps,
and a sim worker charges it to the step after the bytes arrive. Driven on an injected clock:
deterministic."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.bench.engine.step_recorder import StepRecorder, write_profile
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.sim.executor import SimExecutor
from pdserve.sim.fit import fit_kv_receive, fit_linear, fit_spread
from pdserve.sim.kv import SimulatedKV
from pdserve.sim.profiles import parse_profile
from pdserve.sim.timing import Chunk, LinearTiming, StepWork
from tests.sim.conftest import LLAMA_8B_SHAPE

COEFFICIENTS = dict(step_s=0.002, prefill_token_s=1e-5, decode_seq_s=1e-4, context_token_s=0.0)
BYTE_S = 2e-9  # seconds of the core per received byte: 0.5 GB/s
DECODE = StepWork.of([Chunk(64, 1, decode=True)], 1)


class Clock:
    """A clock that moves only when slept on, each sleep exactly as long as asked."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _executor(tmp_path, clock: Clock, **profile: float) -> SimExecutor:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"kind": "linear", **COEFFICIENTS, **profile}))
    return SimExecutor(
        LLAMA_8B_SHAPE,
        num_blocks=64,
        block_size=4,
        dtype="bfloat16",
        profile=str(path),
        avoid_token_ids=set(),
        sleep=clock.sleep,
        clock=clock,
    )


def _sequence(request_id: str) -> Sequence:
    prompt = list(range(10, 18))
    seq = Sequence(request_id, [*prompt, 20], len(prompt), SamplingParams(max_tokens=64), 0)
    seq.num_computed_tokens = len(prompt)  # prefilled, its first token out: the next decodes
    return seq


def _decode_step(executor, clock: Clock, seq: Sequence) -> float:
    """One decode step of `seq` started now; its seconds."""
    batch = ScheduledBatch()
    batch.add(seq, 1)
    started = clock.now
    _, tokens, _ = executor.execute(batch, started)
    seq.num_computed_tokens += 1
    seq.token_ids.append(tokens[0])
    return clock.now - started


def _kv(executor: SimExecutor, blocks: int) -> SimulatedKV:
    return executor.read_kv(list(range(blocks)), 0, executor.num_layers)


def test_received_kv_delays_the_next_step_that_goes_straight_on_once(tmp_path):
    clock = Clock()
    executor = _executor(tmp_path, clock, kv_receive_byte_s=BYTE_S)
    seq = _sequence("a")
    mean = LinearTiming(**COEFFICIENTS).step_seconds(StepWork.of([Chunk(8, 1, True)], 1))
    assert _decode_step(executor, clock, seq) == pytest.approx(mean)
    kv = _kv(executor, 3)
    executor.write_kv([0, 1, 2], 0, kv)  # another request's prompt KV arrives meanwhile
    charge = kv.nbytes * BYTE_S
    assert _decode_step(executor, clock, seq) == pytest.approx(mean + charge)
    assert _decode_step(executor, clock, seq) == pytest.approx(mean)  # charged once
    stats = executor.stats()
    assert stats["sim_kv_receive_seconds"] == pytest.approx(charge)
    assert stats["sim_gap_seconds"] == pytest.approx(charge)  # the delay is a gap, not work
    # An idle worker waits on nothing: KV received before a step of a new request is free.
    executor.write_kv([0, 1, 2], 0, kv)
    clock.now += 1.0
    assert _decode_step(executor, clock, _sequence("b")) == pytest.approx(mean)


def test_a_profile_without_the_charge_receives_kv_for_free(tmp_path):
    clock = Clock()
    executor = _executor(tmp_path, clock)
    seq = _sequence("a")
    first = _decode_step(executor, clock, seq)
    executor.write_kv([0, 1, 2], 0, _kv(executor, 3))
    assert _decode_step(executor, clock, seq) == pytest.approx(first)
    assert executor.stats()["sim_kv_receive_seconds"] == 0


def test_the_fit_finds_the_cost_per_byte_among_noisy_and_idle_steps():
    rng = random.Random(3)
    gaps, received = [], []
    for i in range(1500):
        nbytes = rng.choice([0] * 6 + [65536, 131072, 262144])
        busy = i % 10 != 0
        # The loop's own work plus what receiving cost, scattered; now and then a stall.
        gap = 0.0002 + BYTE_S * nbytes + rng.uniform(0, 0.0001)
        if rng.random() < 0.05:
            gap += 0.005
        gaps.append(gap if busy else 0.0)
        received.append(nbytes)
    assert fit_kv_receive(gaps, received) == pytest.approx(BYTE_S, rel=0.1)
    assert fit_kv_receive(gaps, [0] * len(gaps)) == 0  # nothing received: nothing to charge
    # Gaps that do not grow with the bytes: no charge, never a negative one.
    flat = [0.0003 if nbytes else 0.0004 for nbytes in received]
    assert fit_kv_receive(flat, received) == 0
    with pytest.raises(ValueError):
        fit_kv_receive(gaps, received[:-1])


def test_the_spread_keeps_the_gaps_less_what_the_received_bytes_explain():
    timing = LinearTiming(**COEFFICIENTS, kv_receive_byte_s=BYTE_S)
    samples = [(DECODE, 0.003)] * 4
    gaps = [0.0, 0.001, 0.001, 0.0001]
    received = [100_000, 0, 250_000, 100_000]
    spread = fit_spread(timing, samples, gaps, received=received).spread
    # An idle step keeps its 0; a busy one loses what its bytes explain, never below 0.
    assert [gap for _, gap, _ in spread.decode] == pytest.approx([0.0, 0.001, 0.0005, 0.0])
    with pytest.raises(ValueError):
        fit_spread(timing, samples, gaps, received=received[:-1])


def test_the_recorder_counts_the_kv_written_before_each_step(tmp_path):
    clock = Clock()
    inner = _executor(tmp_path, clock)
    recorder = StepRecorder(inner)
    seq = _sequence("a")
    kv = _kv(inner, 2)
    _decode_step(recorder, clock, seq)
    recorder.write_kv([0, 1], 0, kv)
    recorder.write_kv([0, 1], 0, kv)
    _decode_step(recorder, clock, seq)
    _decode_step(recorder, clock, seq)
    samples, gaps, received = recorder.take()
    assert len(samples) == len(gaps) == 3 and received == [0, 2 * kv.nbytes, 0]
    assert recorder.take() == ([], [], [])


def test_a_fitted_charge_is_written_to_the_profile_and_older_files_read_as_none(tmp_path):
    truth = LinearTiming(**COEFFICIENTS)
    rng = random.Random(5)
    decodes = [
        StepWork.of([Chunk(64 + i % 7, 1, True)] * (1 + i % 3), 1 + i % 3) for i in range(300)
    ]
    prefills = [StepWork.of([Chunk(0, 16 + 8 * (i % 5), False)], 1) for i in range(100)]
    works = decodes + prefills
    samples = [(w, truth.step_seconds(w) * rng.uniform(0.9, 1.1)) for w in works]
    received = [rng.choice([0, 0, 0, 200_000]) for _ in works]
    gaps = [0.0003 + BYTE_S * nbytes for nbytes in received]
    path = tmp_path / "served.json"
    summary = write_profile(samples, str(path), every_sample=True, gaps=gaps, received=received)
    profile = parse_profile(str(path))
    assert profile.kv_receive_byte_s == pytest.approx(BYTE_S, rel=1e-3)
    assert "KV received" in summary
    # What the charge explains is off the replayed gaps: each is the loop's own 0.3 ms.
    spread = profile.spread
    assert {round(gap, 6) for _, gap, _ in spread.decode + spread.prefill} == {0.0003}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"kind": "linear", **COEFFICIENTS}))
    assert parse_profile(str(old)).kv_receive_byte_s == 0
    assert fit_linear(samples).kv_receive_byte_s == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "linear", **COEFFICIENTS, "kv_receive_byte_s": -1}))
    with pytest.raises(ValueError, match="kv_receive_byte_s"):
        parse_profile(str(bad))
