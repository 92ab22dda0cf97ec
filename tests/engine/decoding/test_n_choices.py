"""n choices of one request: the prompt is computed once, the choices fork its KV blocks, and
seeded choice i equals a single request seeded with seed + i — in one engine and across a
prefill/decode handoff. Every block is free afterwards, whatever finished or was aborted."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts

BS = 4
SAMPLED = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True, logprobs=True)


def run_choices(engine, request_id: str, prompt, params, limit: int = 500) -> dict[int, list]:
    """Every choice's tokens and finish reason; checks the request's outputs end it once."""
    engine.add_request(request_id, prompt, params)
    return drain(engine, request_id, limit)


def drain(engine, request_id: str, limit: int = 500) -> dict[int, list]:
    got: dict[int, list] = {}
    ended = 0
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id != request_id:
                continue
            tokens, _ = got.setdefault(out.index, [[], None])
            tokens += out.new_token_ids
            if out.finished:
                got[out.index][1] = out.finish_reason
            ended += out.ends_request
    assert ended == 1
    return got


def single(make_engine, prompt, params) -> list[int]:
    engine = make_engine()
    return engine.generate([prompt], params)[0]


def assert_all_free(engine) -> None:
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == stats["num_reserved"] == 0
    engine.block_manager.check_invariants()


@pytest.mark.parametrize("length", [9, 12], ids=["partial-last-block", "block-boundary"])
def test_seeded_choice_i_equals_a_single_request_with_seed_plus_i(make_engine, length):
    prompt = random_prompts([length], seed=3)[0]
    params = dataclasses.replace(SAMPLED, n=3)
    engine = make_engine()
    got = run_choices(engine, "r", prompt, params)
    for i in range(3):
        alone = single(make_engine, prompt, dataclasses.replace(SAMPLED, seed=SAMPLED.seed + i))
        assert got[i] == [alone, "length"], i
    assert len({tuple(tokens) for tokens, _ in got.values()}) == 3  # different seeds differ
    # The prompt was computed once, not once per choice.
    assert engine.stats()["prefill_tokens_computed"] == length
    assert_all_free(engine)


def test_greedy_choices_are_all_the_greedy_output(make_engine):
    prompt = random_prompts([10], seed=4)[0]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = single(make_engine, prompt, greedy)
    engine = make_engine()
    got = run_choices(engine, "r", prompt, dataclasses.replace(greedy, n=4))
    assert got == {i: [expected, "length"] for i in range(4)}
    assert_all_free(engine)


@pytest.mark.parametrize(("length", "copies"), [(9, 2), (12, 0)])
def test_forks_copy_only_the_partial_last_block(make_engine, length, copies):
    """Prompt of 9 tokens = 2 full blocks + 1 partial: each of n - 1 forks copies the partial
    block before its first write, the full ones stay shared; at a boundary nothing is copied."""
    engine = make_engine()
    made: list = []
    copy_blocks = engine.executor.copy_blocks
    engine.executor.copy_blocks = lambda pairs: (made.extend(pairs), copy_blocks(pairs))
    prompt = random_prompts([length], seed=6)[0]
    run_choices(engine, "r", prompt, SamplingParams(max_tokens=3, n=3, ignore_eos=True))
    assert len(made) == copies


def test_aborting_a_forked_request_frees_every_block(make_engine):
    engine = make_engine()
    prompt = random_prompts([13], seed=8)[0]
    engine.add_request("r", prompt, dataclasses.replace(SAMPLED, n=4, max_tokens=50))
    engine.add_request("other", prompt[:9], SAMPLED)
    for _ in range(4):
        engine.step()
    assert engine.stats()["num_running"] == 5
    engine.abort("r")
    engine.abort("r")  # idempotent
    assert engine.stats()["num_running"] == 1
    drain(engine, "other")
    assert_all_free(engine)


def test_choices_finish_on_their_own(make_engine):
    """A choice that stops early ends alone; the request ends with its last choice."""
    prompt = random_prompts([7], seed=9)[0]
    params = dataclasses.replace(SAMPLED, n=3, max_tokens=8)
    expected = [
        single(make_engine, prompt, dataclasses.replace(params, n=1, seed=params.seed + i))
        for i in range(3)
    ]
    stop = expected[1][2]  # choice 1's third token stops it
    got = run_choices(
        make_engine(), "r", prompt, dataclasses.replace(params, stop_token_ids=[stop])
    )
    assert got[1] == [expected[1][:3], "stop"]
    for i in (0, 2):
        tokens = expected[i]
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert got[i] == [tokens[:cut], "stop" if stop in tokens else "length"]


@pytest.mark.parametrize("length", [9, 12], ids=["partial-last-block", "block-boundary"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "prefix-hit"])
def test_handoff_forks_on_the_decode_engine(make_engine, length, warm):
    """The prefill engine computes the prompt and choice 0's first token; the decode engine
    recomputes the last prompt position once for the other choices and forks them."""
    prompt = random_prompts([length], seed=12)[0]
    params = dataclasses.replace(SAMPLED, n=3)
    prefill, decode = make_engine(), make_engine()
    if warm:
        decode.generate([prompt[:8] + [3]], SamplingParams(max_tokens=1))
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = prefill.step()[0]
    assert first.finish_reason == "prefill"
    reservation = decode.reserve("r", prompt, params)
    src = [first.block_ids[i] for i in reservation.missing_block_indices]
    dst = [reservation.block_ids[i] for i in reservation.missing_block_indices]
    decode.write_kv(dst, 0, prefill.read_kv(src, 0, prefill.num_layers))
    prefill.release("r")
    decode.commit("r", first.new_token_ids[0], first.new_logprobs[0])
    got = drain(decode, "r")
    got[0][0] = first.new_token_ids + got[0][0]
    for i in range(3):
        alone = single(make_engine, prompt, dataclasses.replace(SAMPLED, seed=SAMPLED.seed + i))
        assert got[i] == [alone, "length"], i
    assert_all_free(decode)
    assert_all_free(prefill)


def test_a_handoff_whose_choice_0_stops_at_once_still_serves_the_others(make_engine):
    prompt = random_prompts([9], seed=13)[0]
    params = dataclasses.replace(SAMPLED, n=2, max_tokens=1)
    prefill, decode = make_engine(), make_engine()
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = prefill.step()[0]
    assert first.finish_reason == "prefill"  # held for the handoff although max_tokens is 1
    reservation = decode.reserve("r", prompt, params)
    decode.write_kv(reservation.block_ids, 0, prefill.read_kv(first.block_ids, 0, 2))
    prefill.release("r")
    decode.commit("r", first.new_token_ids[0], first.new_logprobs[0])
    got = drain(decode, "r")
    alone = single(make_engine, prompt, dataclasses.replace(params, n=1, seed=params.seed + 1))
    assert got == {0: [[], "length"], 1: [alone, "length"]}
    assert_all_free(decode)
