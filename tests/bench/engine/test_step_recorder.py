"""The real engine's steps, recorded through the executor seam, fit a linear --sim-profile that
the sim profile parser accepts and that predicts those steps."""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.bench.engine.step_recorder import StepRecorder, fastest_per_work, write_profile
from pdserve.cli import main
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.sim.profiles import parse_profile
from pdserve.sim.timing import Chunk, LinearTiming, StepWork

# The fit keeps the fastest of alike steps: enough repeats that one of each ran unpreempted.
REPEATS = 8
COEFFICIENTS = ("step_s", "prefill_token_s", "decode_seq_s", "context_token_s")


def test_bench_engine_writes_a_profile_the_sim_accepts(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    argv = ["bench", "engine", "--preset", "tiny", "--batch-sizes", "1,4", "--steps", "6"]
    assert main([*argv, "--repeats", "1", "--profile-out", str(path)]) == 0
    summary = re.search(
        r"^profile .*: (\d+) steps, \d+ distinct, .* median error (\d+)%$",
        capsys.readouterr().out,
        re.M,
    )
    assert summary, "the bench prints the fit"
    # Warm-up steps are left out: the table's 1 prefill and 5 decodes per batch size, then
    # the calibration's requests arriving one per step (1 + 4) and decoding to the end.
    assert int(summary.group(1)) == 2 * 6 + (1 + 5) + (4 + 5)
    profile = parse_profile(str(path))
    assert isinstance(profile, LinearTiming)
    assert all(getattr(profile, name) >= 0 for name in COEFFICIENTS)
    assert profile.step_seconds(StepWork.of([Chunk(16, 1, decode=True)], 1)) > 0


def test_a_profile_out_in_a_missing_directory_is_refused_before_measuring(tmp_path):
    missing = tmp_path / "no-such-dir" / "cpu.json"
    with pytest.raises(SystemExit, match="--profile-out .*: no such directory"):
        main(["bench", "engine", "--preset", "tiny", "--profile-out", str(missing)])


@pytest.fixture
def torch_threads_restored():
    """torch's threads as they were after the test: an engine's `num_threads` sets them for
    the whole process."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_recorded_steps_are_the_scheduled_work_and_the_fit_predicts_them(
    tmp_path, torch_threads_restored
):
    # One thread: the tests run beside another test worker on the same cores, and a step of
    # two threads waits for whichever of them was preempted (one run in four fitted a 5 ms
    # cost per prompt step to ~1 ms steps so).
    engine = LLMEngine(
        EngineConfig(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, num_threads=1)
    )
    recorder = engine.executor = StepRecorder(engine.executor)
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 90, 41, 7, 60)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 5, 3, 9, 20, 6)]
    for repeat in range(REPEATS):
        # A first token of its own keeps every prompt out of the prefix cache.
        engine.generate([[100 + 10 * repeat + i, *p] for i, p in enumerate(prompts)], params)
    work = [w for w, _ in recorder.samples]
    # Every prompt token is computed once as prefill, every output token after the first
    # once as a decode; 90 prompt tokens take two chunks of the 64-token budget.
    assert sum(w.prefill_tokens for w in work) == REPEATS * sum(len(p) + 1 for p in prompts)
    assert sum(w.decode_seqs for w in work) == REPEATS * sum(p.max_tokens - 1 for p in params)
    assert max(w.new_tokens for w in work) <= 64
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # still a working engine

    path = tmp_path / "profile.json"
    summary = write_profile(recorder.samples, str(path), device="cpu")
    fitted = parse_profile(str(path))
    assert all(getattr(fitted, name) >= 0 for name in COEFFICIENTS)
    # Loose: a shared two-core machine times millisecond steps with noise.
    steps = fastest_per_work(recorder.samples)
    assert len(steps) < len(recorder.samples) / 2  # the repeats' steps are alike
    predicted = sum(fitted.step_seconds(w) for w, _ in steps)
    measured = sum(s for _, s in steps)
    assert 0.7 < predicted / measured < 1.3, summary
    # The per-step median error is not asserted: the tiny model's steps are a fraction of a
    # millisecond, and on a loaded 2-core CI runner one full run measured 115% with every
    # slope fitted to 0 while the total above held. `bench engine` reports it.
    assert re.search(r"median error \d+%", summary), summary
