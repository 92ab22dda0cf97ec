"""Whatever requests arrive (n > 1 and beam search ones fork their blocks), finish or are aborted in whatever
order, the engine ends with every block free and no block both free and in use along the way;
also with speculative decoding, whose drafts are trimmed and rolled back every step."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdserve.core.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["", "ngram"], ids=["plain", "speculative"])
def engine(tiny_dir, request):
    """With speculation (prompt lookup over these few token ids proposes often), every step also
    appends drafts, trims them to the budget and rolls rejected ones back."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig, SpeculativeConfig

    spec = SpeculativeConfig(method=request.param, num_speculative_tokens=5, min_acceptance=0.0)
    return LLMEngine(
        EngineConfig(
            model=str(tiny_dir),
            block_size=4,
            num_kv_blocks=24,
            max_num_batched_tokens=16,
            speculative=spec,
        )
    )


_ids = itertools.count()  # the engine outlives one example: ids must not repeat

action = st.one_of(
    st.tuples(
        st.just("add"), st.lists(st.integers(3, 8), min_size=1, max_size=30), st.integers(1, 12)
    ),
    st.tuples(
        st.just("prefill_only"),
        st.lists(st.integers(3, 8), min_size=1, max_size=20),
        st.integers(1, 4),
    ),
    st.tuples(
        st.just("reserve"), st.lists(st.integers(3, 8), min_size=1, max_size=20), st.integers(1, 4)
    ),
    st.tuples(
        st.just("add_n"), st.lists(st.integers(3, 8), min_size=1, max_size=14), st.integers(1, 8)
    ),
    st.tuples(
        st.just("add_beam"), st.lists(st.integers(3, 8), min_size=1, max_size=14), st.integers(1, 6)
    ),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=st.lists(action, max_size=25))
# Always run as well: a repeating prompt whose lookup drafts, and whose drafts the tiny model
# (seed 0) rejects in part, so test_speculation_was_exercised does not depend on the draws.
@example(actions=[("add", [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4], 12)])
def test_all_blocks_free_after_everything_finishes(engine, actions):
    ids: list[str] = []
    reserved: list[str] = []
    for kind, arg, max_tokens in actions:
        params = SamplingParams(max_tokens=max(max_tokens, 1), ignore_eos=True)
        if kind in ("add", "prefill_only"):
            ids.append(f"r{next(_ids)}")
            engine.add_request(ids[-1], arg, params, prefill_only=kind == "prefill_only")
        elif kind == "add_n":  # n choices forked from one prefill (copy-on-write blocks)
            ids.append(f"r{next(_ids)}")
            n = 2 + len(arg) % 3
            sampled = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=len(arg))
            engine.add_request(ids[-1], arg, dataclasses.replace(sampled, ignore_eos=True))
        elif kind == "add_beam":  # beams fork, are freed and re-forked every step
            ids.append(f"r{next(_ids)}")
            beam = SamplingParams(max_tokens=max_tokens, beam_width=2 + len(arg) % 2, n=1)
            engine.add_request(ids[-1], arg, dataclasses.replace(beam, ignore_eos=True))
        elif kind == "reserve":
            ids.append(f"r{next(_ids)}")
            reserved.append(ids[-1])
            engine.reserve(ids[-1], arg, params)
        elif kind == "abort" and ids:
            engine.abort(ids[arg % len(ids)])
        else:
            engine.step()
        engine.block_manager.check_invariants()
    # What a server does next: held prompts are released once pushed, and reservations that
    # never get their KV expire. Until then they may hold every block, and waiting requests
    # rightly wait.
    for rid in ids:
        engine.release(rid)
    for rid in reserved:
        engine.abort(rid)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.block_manager.check_invariants()
    else:
        raise AssertionError(f"no progress after 2000 steps: {engine.stats()}")
    for rid in ids:  # prefill-only requests that finished while draining are held now
        engine.release(rid)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_held"] == stats["num_reserved"] == stats["num_running"] == 0


def test_speculation_was_exercised(engine):
    """Runs after the property test on the same engine: its examples drafted, and rejected
    drafts were rolled back."""
    stats = engine.stats()
    if engine.config.speculative.enabled:
        assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"], stats
    else:
        assert stats["spec_draft_tokens"] == 0
