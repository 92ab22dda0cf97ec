"""Async scheduling (engine/gpu_step/overlapped_steps.py): plain greedy decode steps launched
before the previous step's tokens are back give the same tokens as steps one at a time — with
stops in flight, arrivals, aborts, requests that cannot overlap, a disaggregated handoff,
prefix-cache hits and the compiled path — and leave no block behind. On CPU a launch computes at
once, so these check the bookkeeping (placeholders, landing one step later); `pdserve selftest
--device cuda` compares both on a GPU, where the launch does not wait."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.gpu_step.compiled_decode import resolve_placeholders
from tests.engine.conftest import random_prompts
from tests.engine.test_disaggregation import handoff

LENGTHS = [5, 17, 33, 40, 9, 3, 21]
MAX_TOKENS = [10, 3, 25, 7, 1, 16, 12]


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)


def run_steps(engine, arrivals, aborts=()) -> dict[str, list[int]]:
    """Steps until idle; arrivals: {step: [(request id, prompt, params)]}, aborts: {step: id}.
    Returns each request's tokens and checks nothing arrives for an aborted one."""
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    step = 0
    while engine.has_unfinished() or step <= max(arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            tokens[rid] = []
        if step in dict(aborts):
            rid = dict(aborts)[step]
            engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in aborted, "an output after the abort"
            tokens[out.request_id] += out.new_token_ids
        step += 1
    return tokens


def both(make_engine, scenario, **settings):
    """The scenario on an engine stepping one at a time and on one overlapping; both engines."""
    one_at_a_time = make_engine(async_scheduling=False, **settings)
    overlapping = make_engine(async_scheduling=True, **settings)
    return scenario(one_at_a_time), scenario(overlapping), one_at_a_time, overlapping


def assert_idle(engine) -> None:
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert not engine.has_unfinished()


def test_placeholders_take_the_previous_launch_tokens():
    ids = torch.tensor([7, -1, -3, 0, -2])
    assert resolve_placeholders(ids, torch.tensor([40, 41, 42])).tolist() == [7, 40, 42, 0, 41]


def test_overlapped_steps_give_the_same_tokens(make_engine):
    prompts = random_prompts(LENGTHS, seed=3)
    params = [greedy(m) for m in MAX_TOKENS]
    expected, got, _, engine = both(make_engine, lambda e: e.generate(prompts, params))
    assert got == expected
    stats = engine.stats()
    assert stats["overlapped_steps"] > stats["steps"] // 2
    assert_idle(engine)


def test_a_stop_in_flight_drops_the_extra_step_and_its_token(make_engine):
    """Requests that stop on a token (a stop token id, a stop string) mid-batch: the overlapping
    engine has already launched one more step for them when the stop lands."""
    prompts = random_prompts(LENGTHS, seed=4)
    free = make_engine(async_scheduling=False).generate(prompts, [greedy(20)] * len(prompts))
    # Each request stops at the token it would generate 2nd to 9th.
    params = [greedy(20, stop_token_ids=[out[1 + i]]) for i, out in enumerate(free)]
    params[2] = greedy(20, stop=[make_engine().tokenizer.decode(free[2][3:5])])
    expected, got, _, engine = both(make_engine, lambda e: e.generate(prompts, params))
    assert got == expected
    assert all(len(tokens) < 20 for tokens in got)
    assert engine.stats()["overlapped_steps"] > 0
    assert_idle(engine)


def test_arrivals_and_an_abort_while_steps_overlap(make_engine):
    prompts = random_prompts([12, 30, 7, 19, 25], seed=5)
    arrivals = {
        0: [("a", prompts[0], greedy(30)), ("b", prompts[1], greedy(24))],
        6: [("c", prompts[2], greedy(12))],
        9: [("d", prompts[3], greedy(18))],
        15: [("e", prompts[4], greedy(9))],
    }

    def scenario(engine):
        return run_steps(engine, arrivals, aborts=[(12, "b")])

    expected, got, _, engine = both(make_engine, scenario)
    for rid in "acde":  # b's count depends on when its last tokens were out
        assert got[rid] == expected[rid]
    assert got["b"] == expected["b"][: len(got["b"])]
    assert engine.stats()["overlapped_steps"] > 0
    assert_idle(engine)


def test_requests_that_cannot_overlap_step_one_at_a_time(make_engine):
    """Sampling, logprobs, n and repetition penalty need the host between steps: while one of
    them runs, no step overlaps; the greedy ones around them still give the same tokens."""
    prompts = random_prompts([11, 14, 9, 20], seed=6)
    params = [
        greedy(8),
        SamplingParams(max_tokens=8, temperature=0.8, top_k=40, seed=11, ignore_eos=True),
        greedy(8, logprobs=True),
        greedy(8, repetition_penalty=1.3),
    ]
    expected, got, _, engine = both(make_engine, lambda e: e.generate(prompts, params))
    assert got == expected
    assert engine.stats()["overlapped_steps"] == 0
    alone = make_engine(async_scheduling=True)
    alone.generate(prompts[:1], params[:1])
    assert alone.stats()["overlapped_steps"] > 0
    n_two = make_engine(async_scheduling=True)
    n_two.generate(prompts[:1], [greedy(8, n=2)])
    assert n_two.stats()["overlapped_steps"] == 0
    assert_idle(n_two)


def test_a_handoff_joins_an_overlapping_decode_batch(make_engine):
    """The decode side of disaggregation: a committed request joins while steps overlap."""
    prompts = random_prompts([13, 30, 22], seed=7)

    def scenario(decode):
        for i, prompt in enumerate(prompts[:2]):
            decode.add_request(f"local-{i}", prompt, greedy(20))
        for _ in range(4):
            decode.step()
        prefill = make_engine()
        tokens, _ = handoff(prefill, decode, "remote", prompts[2], greedy(10))
        return tokens

    expected, got, one, overlapping = both(make_engine, scenario)
    assert got == expected
    assert overlapping.stats()["overlapped_steps"] > 0
    assert_idle(overlapping)
    assert_idle(one)


def test_prefix_cache_hits_after_overlapped_steps(make_engine):
    """Blocks are cached from landed (real) tokens: a second request extending the first's
    output hits them and gives the same tokens as one stepping one at a time."""
    prompt = random_prompts([18], seed=8)[0]

    def scenario(engine):
        first = engine.generate([prompt], greedy(16))[0]
        second = engine.generate([prompt + first], greedy(6))[0]
        return first, second, engine.stats()["prefix_hit_tokens"]

    expected, got, _, engine = both(make_engine, scenario)
    assert got == expected
    assert got[2] >= 32  # the prompt's and the output's full blocks
    assert_idle(engine)


def test_no_preemption_while_steps_overlap(make_engine):
    """A pool too small for every request: the scheduler preempts, which needs every token on
    the host, so those steps run one at a time; tokens equal, no block leaks."""
    prompts = random_prompts([9, 14, 11, 16, 7], seed=9)
    params = [greedy(24)] * len(prompts)
    settings = dict(num_kv_blocks=24, max_num_seqs=5)
    expected, got, one, engine = both(
        make_engine, lambda e: e.generate(prompts, params), **settings
    )
    assert got == expected
    assert one.stats()["num_preemptions"] > 0
    assert engine.stats()["overlapped_steps"] > 0
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [None, False])
def test_async_scheduling_is_off_on_cpu_unless_asked(make_engine, async_scheduling):
    assert not make_engine(async_scheduling=async_scheduling).async_scheduling
    assert make_engine(async_scheduling=True).async_scheduling


def test_compiled_steps_overlap_with_the_same_tokens(make_engine):
    """The compiled decode path puts the placeholders' tokens into its input buffer."""
    prompts = random_prompts([5, 9, 16, 23], seed=10)
    params = [greedy(12)] * len(prompts)
    expected = make_engine(async_scheduling=False).generate(prompts, params)
    engine = make_engine(compile=True, async_scheduling=True, max_num_seqs=4)
    assert engine.generate(prompts, params) == expected
    stats = engine.stats()
    assert stats["overlapped_steps"] > 0 and stats["compiled_decode_steps"] > 0
    assert_idle(engine)
