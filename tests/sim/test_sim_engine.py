"""The engine with the sim executor: pdserve's scheduler, block manager and prefix cache run as
on the torch path, tokens are a function of the context and steps last what the model says."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine_config import SimConfig
from tests.sim.conftest import VOCAB

GREEDY = SamplingParams(max_tokens=8)
PROMPTS = [list(range(10, 30)), list(range(100, 107)), [5, 6, 7, 8, 9, 10, 11, 12, 13]]


def test_tokens_are_a_function_of_the_context(make_sim_engine):
    alone = make_sim_engine().generate([PROMPTS[0]], GREEDY)[0]
    batched = make_sim_engine().generate(PROMPTS, GREEDY)
    assert batched[0] == alone  # the rest of the batch does not matter
    assert len({tuple(t) for t in batched}) == len(PROMPTS)  # other contexts, other tokens
    produced = {t for tokens in batched for t in tokens}
    assert produced.isdisjoint({0, 1})  # never BOS or EOS: requests end by their limits
    assert all(0 <= t < VOCAB for t in produced)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in batched)


def test_a_retry_continues_the_same_stream(make_sim_engine):
    for params in (GREEDY, SamplingParams(max_tokens=8, temperature=0.9, seed=7)):
        full = make_sim_engine().generate([PROMPTS[0]], params)[0]
        retry_params = SamplingParams(
            max_tokens=5, temperature=params.temperature, seed=params.seed, seed_offset=3
        )
        retry = make_sim_engine().generate([PROMPTS[0] + full[:3]], retry_params)[0]
        assert retry == full[3:]


def test_seeds_change_sampled_tokens_and_logprobs_are_reported(make_sim_engine):
    engine = make_sim_engine()
    runs = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=seed, logprobs=True) for seed in (1, 2)
    ]
    a, b = engine.generate([PROMPTS[1]] * 2, runs)
    assert a != b
    engine.add_request("lp", PROMPTS[1], runs[0])
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    logprobs = [lp for out in outputs for lp in out.new_logprobs]
    assert len(logprobs) == 8 and all(-10 < lp <= 0 for lp in logprobs)


def test_prefix_hits_reuse_blocks(make_sim_engine):
    engine = make_sim_engine()
    shared = list(range(40, 72))  # 8 full blocks
    first = engine.generate([shared + [3]], GREEDY)[0]
    second = engine.generate([shared + [4]], GREEDY)[0]
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] == len(shared)
    assert engine.stats()["prefill_tokens_computed"] == len(shared) + 2
    assert first == make_sim_engine().generate([shared + [3]], GREEDY)[0]
    assert second == make_sim_engine().generate([shared + [4]], GREEDY)[0]


def test_preemption_recomputes_to_the_same_tokens(make_sim_engine):
    params = SamplingParams(max_tokens=24)
    prompts = [list(range(10 * i + 3, 10 * i + 15)) for i in range(4)]
    roomy = make_sim_engine().generate(prompts, params)
    tight_engine = make_sim_engine(num_kv_blocks=20)
    assert tight_engine.generate(prompts, params) == roomy
    assert tight_engine.stats()["num_preemptions"] > 0
    assert tight_engine.stats()["num_used_blocks"] == 0


def test_abort_and_release_free_every_block(make_sim_engine):
    engine = make_sim_engine()
    engine.add_request("running", PROMPTS[0], SamplingParams(max_tokens=100))
    engine.add_request("held", PROMPTS[1], GREEDY, prefill_only=True)
    held = [out for _ in range(3) for out in engine.step() if out.request_id == "held"]
    assert held[0].finish_reason == "prefill" and held[0].block_ids
    reservation = engine.reserve("reserved", PROMPTS[2], GREEDY)
    assert reservation is not None
    assert engine.stats()["num_held"] == 1 and engine.stats()["num_reserved"] == 1
    engine.abort("running")
    engine.release("held")
    engine.abort("reserved")
    assert engine.stats()["num_used_blocks"] == 0
    assert not engine.has_unfinished()


def test_steps_last_the_modelled_time(make_sim_engine, tmp_path):
    profile = tmp_path / "slow.json"
    coefficients = dict(step_s=0.02, prefill_token_s=0.0, decode_seq_s=0.0, context_token_s=0.0)
    profile.write_text(json.dumps({"kind": "linear", **coefficients}))
    for scale in (1.0, 2.0):
        engine = make_sim_engine(sim=SimConfig(profile=str(profile), time_scale=scale))
        started = time.perf_counter()
        engine.generate([PROMPTS[1]], SamplingParams(max_tokens=5))
        elapsed = time.perf_counter() - started
        stats = engine.stats()
        assert stats["steps"] == 5
        assert abs(stats["sim_modelled_seconds"] - 0.1) < 1e-9  # in simulated time
        assert 0.1 * scale <= elapsed < 0.1 * scale + 0.5
        assert stats["sim_measured_seconds"] >= stats["sim_modelled_seconds"]
        assert stats["sim_overrun_steps"] == 0


def test_steps_faster_than_python_count_as_overruns(make_sim_engine, tmp_path):
    profile = tmp_path / "instant.json"
    coefficients = dict(step_s=1e-9, prefill_token_s=0.0, decode_seq_s=0.0, context_token_s=0.0)
    profile.write_text(json.dumps({"kind": "linear", **coefficients}))
    engine = make_sim_engine(sim=SimConfig(profile=str(profile)))
    engine.generate([PROMPTS[1]], SamplingParams(max_tokens=5))
    stats = engine.stats()
    assert stats["sim_overrun_steps"] == stats["steps"] == 5
    assert stats["sim_measured_seconds"] > stats["sim_modelled_seconds"]


def test_a_sim_engine_never_imports_torch(sim_model_dir):
    script = f"""
import sys
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from tests.sim.conftest import sim_config
engine = LLMEngine(sim_config({str(sim_model_dir)!r}))
assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]
engine.read_kv([0], 0, 2)
print("torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_n_choices_fork_on_sim_and_beam_search_is_refused(make_sim_engine):
    """n samples fork as on the torch path (copies counted, no bytes); beam search needs
    candidates the simulated model does not have: refused, naming the field."""
    engine = make_sim_engine()
    sampled = SamplingParams(max_tokens=5, temperature=0.9, seed=7)
    engine.add_request("r", PROMPTS[2], dataclasses.replace(sampled, n=3))
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.index, []).extend(out.new_token_ids)
    for i in range(3):
        alone = make_sim_engine().generate([PROMPTS[2]], dataclasses.replace(sampled, seed=7 + i))[
            0
        ]
        assert got[i] == alone
    assert engine.stats()["sim_block_copies"] == 2  # the partial last prompt block, per fork
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]
    with pytest.raises(ValueError, match="^beam_width: "):
        engine.add_request("b", PROMPTS[2], SamplingParams(beam_width=2))
