"""The disaggregation hooks: prefill on engine A (prefill_only, held blocks), reserve on engine
B, copy the missing blocks with read_kv/write_kv, commit, decode on B. The result must equal
one engine doing the whole request, and every block must be free afterwards."""

from __future__ import annotations

import pytest

from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts

PROMPT = random_prompts([30], seed=5)[0]  # 7 full blocks of 4 + a partial one
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=7, ignore_eos=True)


def collect(engine, request_id: str) -> tuple[list[int], str]:
    tokens, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                text += out.text_delta
    return tokens, text


def handoff(prefill, decode, request_id, prompt, params, layers_per_chunk=1, cache_blocks=True):
    """What a prefill worker and a decode worker do together; returns all output tokens."""
    prefill.add_request(request_id, prompt, params, prefill_only=True)
    first = prefill.step()[0]
    assert first.finish_reason == "prefill" and first.finished
    assert prefill.stats()["num_held"] == 1
    reservation = decode.reserve(request_id, prompt, params)
    assert reservation is not None
    src = [first.block_ids[i] for i in reservation.missing_block_indices]
    dst = [reservation.block_ids[i] for i in reservation.missing_block_indices]
    for l0 in range(0, prefill.num_layers, layers_per_chunk):
        l1 = min(l0 + layers_per_chunk, prefill.num_layers)
        decode.write_kv(dst, l0, prefill.read_kv(src, l0, l1))
    prefill.release(request_id)
    lp = first.new_logprobs[0] if first.new_logprobs else None
    decode.commit(request_id, first.new_token_ids[0], lp, cache_blocks=cache_blocks)
    rest, _ = collect(decode, request_id)
    return first.new_token_ids + rest, reservation


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("warm_prefix", [0, 12, 30], ids=["cold", "partial-hit", "full-hit"])
def test_handoff_equals_one_engine(make_engine, params, warm_prefix):
    single = make_engine()
    single.add_request("r", PROMPT, params)
    expected, _ = collect(single, "r")

    prefill, decode = make_engine(), make_engine()
    if warm_prefix:  # B already holds part of the prefix in its prefix cache
        decode.generate([PROMPT[:warm_prefix] + [3]], SamplingParams(max_tokens=1))
    got, reservation = handoff(prefill, decode, "r", PROMPT, params)
    assert got == expected
    assert reservation.num_cached_tokens == (warm_prefix // 4) * 4
    assert reservation.missing_block_indices == list(range(warm_prefix // 4, 8))
    for engine in (prefill, decode):
        stats = engine.stats()
        assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        assert stats["num_held"] == stats["num_reserved"] == stats["num_running"] == 0


def test_commit_without_caching_serves_the_request_but_caches_none_of_it(make_engine):
    single = make_engine()
    single.add_request("r", PROMPT, GREEDY)
    expected, _ = collect(single, "r")
    prefill, decode = make_engine(), make_engine()
    decode.generate([PROMPT[:12] + [3]], SamplingParams(max_tokens=1))  # a local prefix
    cached_before = decode.stats()["num_cached_blocks"]
    got, reservation = handoff(prefill, decode, "r", PROMPT, GREEDY, cache_blocks=False)
    assert got == expected and reservation.num_cached_tokens == 12
    # Neither the received prompt blocks nor the blocks decoded on top of them were cached.
    assert decode.stats()["num_cached_blocks"] == cached_before
    assert decode.reserve("again", PROMPT, GREEDY).num_cached_tokens == 12


def test_commit_of_a_token_outside_the_vocabulary_changes_nothing(make_engine):
    engine = make_engine()
    engine.reserve("r", PROMPT, GREEDY)
    vocab = engine.model.config.vocab_size
    for token in (vocab, -1):
        with pytest.raises(ValueError, match="first_token_id"):
            engine.commit("r", token, None)
    assert engine.stats()["num_reserved"] == 1 and not engine.has_unfinished()
    engine.abort("r")
    assert engine.stats()["num_used_blocks"] == 0


def test_prefill_only_that_finishes_at_once_frees_its_blocks(make_engine):
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=1), prefill_only=True)
    out = engine.step()[0]
    assert out.finish_reason == "length" and out.block_ids is None
    assert engine.stats()["num_used_blocks"] == 0
    engine.release("r")  # idempotent


def test_reserve_without_room_returns_none(make_engine):
    engine = make_engine(num_kv_blocks=10)
    assert engine.reserve("a", PROMPT[:24], GREEDY) is not None  # 6 blocks
    assert engine.reserve("b", PROMPT[:24], GREEDY) is None
    assert engine.stats()["num_reserved"] == 1
    engine.abort("a")
    assert engine.stats()["num_free_blocks"] == 10


def test_commit_requires_a_reservation(make_engine):
    with pytest.raises(KeyError):
        make_engine().commit("nope", 5, None)


def test_kv_events_report_stores_and_evictions(make_engine):
    events = []
    engine = make_engine(num_kv_blocks=12, sink=events.extend)
    engine.generate([PROMPT], SamplingParams(max_tokens=1))
    stored = [h for e in events if e.kind == "stored" for h in e.block_hashes]
    assert len(stored) == 7 and all(e.token_count == 4 * len(e.block_hashes) for e in events)
    engine.generate([random_prompts([40], seed=9)[0]], SamplingParams(max_tokens=1))
    removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
    assert removed and set(removed) <= set(stored)


def test_abort_in_every_state_frees_blocks_at_once(make_engine):
    engine = make_engine(max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("running", PROMPT, params)
    engine.add_request("waiting", PROMPT[:20], params)
    engine.step()  # "running" is mid chunked prefill; "waiting" got no budget
    engine.add_request("held", PROMPT[:9], params, prefill_only=True)
    engine.reserve("reserved", PROMPT[:17], params)
    while engine.stats()["num_held"] == 0:
        engine.step()
    stats = engine.stats()
    assert stats["num_running"] >= 1 and stats["num_reserved"] == 1
    for rid in ("waiting", "running", "held", "reserved", "unknown", "running"):
        engine.abort(rid)
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0
    assert stats["num_waiting"] == stats["num_running"] == stats["num_held"] == 0
    assert not engine.has_unfinished()
    assert engine.stats()["prefix_query_tokens"] > 0 and stats["steps"] > 0


def test_committed_handoffs_beyond_max_num_seqs_wait_their_turn(make_engine):
    """Commits join the running sequences without admission, so a step must cap them itself:
    no step runs more than max_num_seqs, and every handoff still finishes with its tokens."""
    prompts = random_prompts([9, 10, 11, 12], seed=11)
    single = make_engine()
    expected = {}
    for k, prompt in enumerate(prompts):
        single.add_request(f"r{k}", prompt, GREEDY)
        expected[f"r{k}"], _ = collect(single, f"r{k}")

    prefill, decode = make_engine(), make_engine(max_num_seqs=2)
    firsts = {}
    for k, prompt in enumerate(prompts):
        rid = f"r{k}"
        prefill.add_request(rid, prompt, GREEDY, prefill_only=True)
        first = prefill.step()[0]
        reservation = decode.reserve(rid, prompt, GREEDY)
        src = [first.block_ids[i] for i in reservation.missing_block_indices]
        dst = [reservation.block_ids[i] for i in reservation.missing_block_indices]
        decode.write_kv(dst, 0, prefill.read_kv(src, 0, prefill.num_layers))
        prefill.release(rid)
        decode.commit(rid, first.new_token_ids[0], first.new_logprobs[0])
        firsts[rid] = first.new_token_ids
    got = {rid: list(tokens) for rid, tokens in firsts.items()}
    scheduled = decode.scheduler.schedule
    sizes = []

    def recording_schedule():
        batch = scheduled()
        sizes.append(len(batch.seqs))
        return batch

    decode.scheduler.schedule = recording_schedule
    while decode.has_unfinished():
        for out in decode.step():
            got[out.request_id] += out.new_token_ids
    assert max(sizes) == 2
    assert got == expected
    assert decode.stats()["num_used_blocks"] == 0
