"""The engine's two sides of a peer pull: X pins the prefix it caches, Y reserves, receives the
blocks past its own hits, commits them as a prefix and prefills the rest. Tokens equal one
engine computing everything, the pulled blocks are X's bytes, and a pull that fails falls back
to the same tokens; no block stays referenced on either side."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts

PROMPT = random_prompts([30], seed=11)[0]  # 7 full blocks of 4 + a partial one
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_k=50, seed=3, ignore_eos=True)
HELD = 24  # X cached the first 6 blocks (a conversation's earlier turn)


def run(engine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens


def holder(make_engine):
    x = make_engine()
    x.generate([PROMPT[:HELD] + [7, 8]], SamplingParams(max_tokens=1))
    return x


def pull(x, y, request_id: str, params: SamplingParams):
    """Y reserves with a pull, X pins and its blocks are copied into Y's, Y commits."""
    reservation = y.reserve(request_id, PROMPT, params, pull=True)
    have = reservation.num_cached_tokens // 4
    src = x.pin_prefix("push-" + request_id, PROMPT[: HELD // 4 * 4])
    dst = reservation.block_ids[have : HELD // 4]
    y.write_kv(dst, 0, x.read_kv(src[have:], 0, x.num_layers))
    x.unpin_prefix("push-" + request_id)
    y.commit_prefix(request_id, HELD // 4, cache_blocks=True)
    return src[have:], dst


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("own_hits", [0, 8], ids=["cold", "own-hits"])
def test_pulled_prefix_generates_like_one_engine(make_engine, params, own_hits):
    expected = make_engine().generate([PROMPT], params)[0]
    x, y = holder(make_engine), make_engine()
    if own_hits:
        y.generate([PROMPT[:own_hits] + [5]], SamplingParams(max_tokens=1))
    src, dst = pull(x, y, "r", params)
    assert len(dst) == HELD // 4 - own_hits // 4
    # The pulled blocks are X's, byte for byte (and Y's prefill did not rewrite them).
    assert torch.equal(y.read_kv(dst, 0, y.num_layers), x.read_kv(src, 0, x.num_layers))
    assert run(y, "r") == expected
    stats = y.stats()
    assert stats["prefix_peer_hit_tokens"] == HELD - own_hits
    assert stats["prefix_hit_tokens"] == HELD
    assert stats["prefill_tokens_computed"] == len(PROMPT) - HELD + own_hits + 1 * bool(own_hits)
    assert (stats["peer_pulls_started"], stats["peer_pulls_committed"]) == (1, 1)
    for engine in (x, y):
        assert engine.stats()["num_used_blocks"] == 0
        engine.block_manager.check_invariants()


def test_pulled_blocks_join_the_prefix_cache(make_engine):
    x, y = holder(make_engine), make_engine()
    pull(x, y, "r", GREEDY)
    run(y, "r")
    assert y.reserve("again", PROMPT, GREEDY).num_cached_tokens == 28


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_failed_pull_falls_back_to_the_same_tokens(make_engine, params):
    expected = make_engine().generate([PROMPT], params)[0]
    y = make_engine()
    reservation = y.reserve("r", PROMPT, params, pull=True)
    garbage = torch.randn_like(y.read_kv(reservation.block_ids[:3], 0, y.num_layers))
    y.write_kv(reservation.block_ids[:3], 0, garbage)  # part of a pull that then died
    assert y.fall_back("r")
    assert not y.fall_back("r")  # no longer reserved
    assert run(y, "r") == expected
    stats = y.stats()
    assert (stats["peer_pulls_fallen_back"], stats["prefix_peer_hit_tokens"]) == (1, 0)
    assert stats["num_used_blocks"] == 0


def test_a_holder_without_the_prefix_pins_nothing(make_engine):
    x = holder(make_engine)
    assert x.pin_prefix("p", PROMPT[:28]) is None  # block 7 was never computed there
    other = list(PROMPT[:HELD])
    other[5] += 1
    assert x.pin_prefix("q", other) is None
    assert x.stats()["num_used_blocks"] == 0
    x.block_manager.check_invariants()


def test_a_prefix_commit_must_extend_the_hits(make_engine):
    y = make_engine()
    y.reserve("r", PROMPT, GREEDY, pull=True)
    with pytest.raises(ValueError, match="does not extend"):
        y.commit_prefix("r", 8, cache_blocks=True)  # the last prompt token is Y's to compute
    with pytest.raises(KeyError):
        y.commit_prefix("unknown", 2, cache_blocks=True)
