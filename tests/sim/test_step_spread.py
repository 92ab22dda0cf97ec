"""The spread of a measured profile (issue 14 point 3): calibration keeps, in recorded order,
how the served steps scattered around the fit and the gaps between steps; a sim executor walks
them from a seeded position, and its tokens do not change."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.engine.step_recorder import write_profile
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine_config import SimConfig
from pdserve.sim.fit import SPREAD_LIMIT, fit_linear, fit_spread
from pdserve.sim.profiles import ProfileError, parse_profile
from pdserve.sim.timing import (
    MIN_CLASS_ENTRIES,
    Chunk,
    LinearTiming,
    StepSpread,
    StepWork,
    size_class,
)

COEFFICIENTS = dict(step_s=0.002, prefill_token_s=1e-5, decode_seq_s=1e-4, context_token_s=0.0)
MEAN = LinearTiming(**COEFFICIENTS)
DECODE = StepWork.of([Chunk(64, 1, decode=True)], 1)
PREFILL = StepWork.of([Chunk(0, 256, decode=False)], 1)
PROMPTS = [list(range(10, 30)), list(range(100, 107))]


def test_fit_spread_keeps_each_step_with_its_gap_in_order_apart_for_decode_and_prefill():
    # A burst: decode steps a little under the mean, then ten in a row three times it.
    decode_ratios = [0.8] * 40 + [3.0] * 10 + [0.8] * 50
    samples = [(DECODE, MEAN.step_seconds(DECODE) * r) for r in decode_ratios]
    gaps = [0.0] + [0.001] * 89 + [0.02] * 10
    samples.insert(20, (PREFILL, MEAN.step_seconds(PREFILL) * 1.1))
    gaps.insert(20, 0.0)
    fitted = fit_spread(MEAN, samples, gaps, seed=4)
    spread = fitted.spread
    assert (fitted.step_s, fitted.prefill_token_s) == (MEAN.step_s, MEAN.prefill_token_s)
    assert [ratio for ratio, _, _ in spread.decode] == pytest.approx(decode_ratios)  # the run kept
    assert [gap for _, gap, _ in spread.decode] == [0.0] + [0.001] * 89 + [0.02] * 10
    # Each step with its fitted seconds: the sim matches steps of a like size.
    assert {fitted for _, _, fitted in spread.decode} == {MEAN.step_seconds(DECODE)}
    assert spread.prefill == ((1.1, 0.0, MEAN.step_seconds(PREFILL)),) and spread.seed == 4
    assert spread.table(DECODE, MEAN.step_seconds(DECODE))[1] == tuple(
        (ratio, gap) for ratio, gap, _ in spread.decode
    )
    assert spread.table(PREFILL, MEAN.step_seconds(PREFILL))[1] == ((1.1, 0.0),)
    count = SPREAD_LIMIT + 5
    many = fit_spread(MEAN, [(DECODE, 0.001 * (i + 1)) for i in range(count)], [0.0] * count)
    assert len(many.spread.decode) == SPREAD_LIMIT  # the last ones
    assert many.spread.decode[-1][0] == pytest.approx(0.001 * count / 0.0021, rel=1e-3)
    with pytest.raises(ValueError):
        fit_spread(MEAN, samples, gaps[:-1])  # one gap per sample


def test_a_profile_with_a_spread_round_trips_and_one_without_reads_as_before(tmp_path):
    samples = [(w, MEAN.step_seconds(w) * r) for r in (0.9, 1.0, 1.3) for w in _varied_steps()]
    path = tmp_path / "served.json"
    gaps = [0.001 * (i % 3) for i in range(len(samples))]
    write_profile(samples, str(path), every_sample=True, gaps=gaps, device="cpu")
    profile = parse_profile(str(path))
    assert isinstance(profile, LinearTiming) and profile.spread is not None
    assert (len(profile.spread.decode), len(profile.spread.prefill)) == (3 * 3, 2 * 3)
    assert {
        gap for table in (profile.spread.decode, profile.spread.prefill) for _, gap, _ in table
    } == {
        0.0,
        0.001,
        0.002,
    }
    assert profile == fit_spread(fit_linear(samples), samples, gaps)  # the file holds it all
    best = tmp_path / "best.json"
    write_profile(samples, str(best))  # `bench engine`: fastest of each step, no spread
    assert "spread" not in json.loads(best.read_text())
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"kind": "linear", **COEFFICIENTS, "device": "cpu"}))
    assert parse_profile(str(old)) == MEAN and MEAN.spread is None
    # A spread of [ratio, gap_s] pairs (written before entries kept their fitted seconds) reads
    # as one table per kind, whatever a step's size.
    pairs = tmp_path / "pairs.json"
    spread = {"decode": [[0.5, 0.001], [2.0, 0.0]], "prefill": [[1.5, 0.0]]}
    pairs.write_text(json.dumps({"kind": "linear", **COEFFICIENTS, "spread": spread}))
    read = parse_profile(str(pairs)).spread
    for fitted in (1e-4, 1.0):
        assert read.table(DECODE, fitted)[1] == ((0.5, 0.001), (2.0, 0.0))
        assert read.table(PREFILL, fitted)[1] == ((1.5, 0.0),)


def test_a_prefill_replays_the_ratios_of_measured_prefills_of_its_size():
    # Calibration's small prompts ran under the fit, its large chunks over it, interleaved;
    # three huge steps are too few to replay on their own.
    small, large, huge = 0.0005, 0.004, 0.064
    entries = [(0.5, 0.0001, small), (2.0, 0.0002, large)] * MIN_CLASS_ENTRIES
    entries += [(9.0, 0.0, huge)] * 3
    spread = StepSpread(prefill=tuple(entries), decode=tuple(entries[:4]))
    for fitted, ratio, gap in ((small, 0.5, 0.0001), (large, 2.0, 0.0002)):
        # Anywhere in the half octave of the measured ones.
        for near in (fitted, fitted * 1.2):
            name, table = spread.table(PREFILL, near)
            assert table == ((ratio, gap),) * MIN_CLASS_ENTRIES, near
            assert name == f"prefill {size_class(fitted)}"
    # A step bigger than any class that holds enough: the nearest that does (not the 3 huge).
    assert spread.table(PREFILL, huge)[1] == ((2.0, 0.0002),) * MIN_CLASS_ENTRIES
    assert spread.table(PREFILL, 1.0)[1] == ((2.0, 0.0002),) * MIN_CLASS_ENTRIES
    # Decode steps: one table, whatever the size.
    assert (
        spread.table(DECODE, small)[1]
        == spread.table(DECODE, large)[1]
        == (
            (0.5, 0.0001),
            (2.0, 0.0002),
        )
        * 2
    )
    # Too few steps in every class: the whole table, whatever the size.
    few = StepSpread(prefill=((1.0, 0.0, small), (3.0, 0.0, large)))
    assert few.table(PREFILL, large)[1] == few.table(PREFILL, small)[1] == ((1.0, 0.0), (3.0, 0.0))
    # Half an octave apart: 1 and 1.4 ms differ in class, 1 and 1.2 ms do not.
    assert size_class(0.001) != size_class(0.0014) and size_class(0.001) == size_class(0.0012)


def test_sim_steps_of_two_sizes_draw_the_ratios_measured_on_their_size(make_sim_engine, tmp_path):
    # A 256-token prefill (4.56 ms fitted) and 1-token decodes (2.1 ms): more than an octave
    # apart. Measured prefills of both sizes, each with its own ratio.
    prompt_step = MEAN.step_seconds(StepWork.of([Chunk(0, 1, False)], 1))
    big = MEAN.step_seconds(PREFILL)
    entries = [[0.5, 0.0, prompt_step], [3.0, 0.0, big]] * MIN_CLASS_ENTRIES
    path = tmp_path / "sized.json"
    spread = {"prefill": entries, "decode": [[1.0, 0.0, MEAN.step_seconds(DECODE)]]}
    path.write_text(json.dumps({"kind": "linear", **COEFFICIENTS, "spread": spread}))
    engine = make_sim_engine(sim=SimConfig(profile=str(path), time_scale=0.001))
    for request_id, prompt in (("short", [7]), ("long", list(range(10, 266)))):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
        before = engine.stats()["sim_modelled_seconds"]
        engine.step()
        modelled = engine.stats()["sim_modelled_seconds"] - before
        fitted = MEAN.step_seconds(StepWork.of([Chunk(0, len(prompt), False)], 1))
        assert modelled / fitted == pytest.approx(0.5 if len(prompt) == 1 else 3.0)
        while engine.has_unfinished():
            engine.step()


@pytest.mark.parametrize(
    "spread, message",
    [
        ([1.0], '"spread" must be an object'),
        ({"decode": [1.0], "tails": []}, "unknown \"spread\" key 'tails'"),
        ({"decode": [[1.0, 0.0], [-0.5, 0.0]]}, "'decode' must be a list of \\[ratio, gap_s\\]"),
        ({"decode": [[1.0]]}, "'decode' must be a list of \\[ratio, gap_s\\] pairs"),
        ({"prefill": "fast"}, "'prefill' must be a list of"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_a_malformed_spread_is_a_one_line_error(tmp_path, spread, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"kind": "linear", **COEFFICIENTS, "spread": spread}))
    with pytest.raises(ProfileError, match=message) as caught:
        parse_profile(str(path))
    assert "\n" not in str(caught.value)


def test_sim_steps_draw_the_measured_ratios_seeded_and_tokens_do_not_change(
    make_sim_engine, tmp_path
):
    ratios = (0.5, 1.0, 4.0, 0.7, 2.5, 1.3, 0.9, 1.6, 3.1, 0.6, 1.1)
    table = [[ratio, 0.0] for ratio in ratios]
    runs = {}
    for name, spread in (("mean", None), ("a", ratios), ("b", ratios), ("seed 1", ratios)):
        data = {"kind": "linear", **COEFFICIENTS}
        if spread:
            data["spread"] = {"decode": table, "prefill": table, "seed": int(name == "seed 1")}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        engine = make_sim_engine(sim=SimConfig(profile=str(path), time_scale=0.01))
        params = [
            SamplingParams(max_tokens=12),
            SamplingParams(max_tokens=9, seed=3, temperature=1),
        ]
        tokens = engine.generate(PROMPTS, params)
        runs[name] = (tokens, engine.stats()["sim_modelled_seconds"])
    assert runs["a"][0] == runs["b"][0] == runs["seed 1"][0] == runs["mean"][0]
    assert runs["a"][1] == runs["b"][1]  # the same steps, the same draws
    assert runs["seed 1"][1] != runs["a"][1]
    assert runs["a"][1] != pytest.approx(runs["mean"][1], rel=1e-3)
    # Every step's time is the mean's times one of the ratios.
    low, high = runs["mean"][1] * min(ratios), runs["mean"][1] * max(ratios)
    assert low < runs["a"][1] < high


def test_a_step_that_continues_a_request_waits_out_a_measured_gap_first(make_sim_engine, tmp_path):
    gap = 0.5  # simulated seconds; scaled by 0.01 it is 5 ms of wall time
    path = tmp_path / "gappy.json"
    spread = {"decode": [[1.0, gap]]}  # steps last the mean, after the gap
    path.write_text(json.dumps({"kind": "linear", **COEFFICIENTS, "spread": spread}))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"kind": "linear", **COEFFICIENTS}))
    modelled = {}
    for name, profile in (("gap", path), ("plain", plain)):
        engine = make_sim_engine(sim=SimConfig(profile=str(profile), time_scale=0.01))
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6))
        stats = engine.stats()
        modelled[name] = stats["sim_modelled_seconds"]
        assert stats["steps"] == 6
    # 5 steps follow one of the same request; each waited what is left of the gap after the
    # engine loop's own Python work between the steps (well under the gap's 5 ms).
    extra = modelled["gap"] - modelled["plain"]
    assert 5 * gap * 0.5 < extra <= 5 * gap + 1e-9


def test_sim_decode_steps_walk_the_measured_ratios_in_recorded_order(make_sim_engine, tmp_path):
    table = [1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0]  # a run of three slow steps
    path = tmp_path / "burst.json"
    spread = {"decode": [[ratio, 0.0] for ratio in table]}
    path.write_text(json.dumps({"kind": "linear", **COEFFICIENTS, "spread": spread}))
    engine = make_sim_engine(sim=SimConfig(profile=str(path), time_scale=0.001))
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=len(table) + 1))
    steps = []
    while engine.has_unfinished():
        before = engine.stats()["sim_modelled_seconds"]
        engine.step()
        steps.append(engine.stats()["sim_modelled_seconds"] - before)
    prefill, decodes = steps[0], steps[1:]
    assert prefill == pytest.approx(MEAN.step_seconds(StepWork.of([Chunk(0, 7, False)], 1)))
    means = [MEAN.step_seconds(StepWork.of([Chunk(7 + i, 1, True)], 1)) for i in range(10)]
    ratios = [round(d / m, 6) for d, m in zip(decodes, means, strict=True)]
    # One lap of the table from wherever the seed started it: the run of slow steps stays a run.
    assert any(ratios == table[k:] + table[:k] for k in range(len(table))), ratios


def _varied_steps() -> list[StepWork]:
    return [DECODE, PREFILL, StepWork.of([Chunk(30, 1, True), Chunk(0, 40, False)], 2)] + [
        StepWork.of([Chunk(c, 1, True)] * n, n) for c, n in ((100, 3), (300, 8))
    ]
