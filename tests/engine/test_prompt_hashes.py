"""The prompt's block hashes are computed once per sequence (or given with a PromptTokens
prompt) and used by the prefix cache: the blocks, hashes and KV events are those of hashing
every block in turn with `block_hash`, the definition."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.block_hash import ROOT_HASH, block_hash
from pdserve.core.prompt_tokens import PromptTokens
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from tests.engine.conftest import random_prompts
from tests.engine.test_disaggregation import handoff

BS = 4


def chained(token_ids: list[int]) -> list[int]:
    """Every full block's hash, block by block (the definition)."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - BS + 1, BS):
        parent = block_hash(parent, token_ids[start : start + BS])
        hashes.append(parent)
    return hashes


def run(prompt: list[int], generated: list[int], chunks: list[int], given_hashes: bool):
    """A sequence's prompt computed in `chunks`, then `generated` decoded one by one; returns
    its block hashes and the block manager's events."""
    bm = BlockManager(64, BS)
    seq = Sequence("r", list(prompt), len(prompt), SamplingParams(), 0)
    if given_hashes:
        seq.prompt_block_hashes = PromptTokens(prompt).block_hashes(BS)
    seq.num_computed_tokens = bm.acquire_prefix(seq, seq.num_tokens - 1)
    for n in chunks:
        n = min(n, seq.num_tokens - seq.num_computed_tokens)
        assert bm.ensure_blocks(seq, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)
    assert bm.ensure_blocks(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    for token in generated:
        seq.token_ids.append(token)
        assert bm.ensure_blocks(seq, seq.num_tokens)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    events = [(e.kind, e.block_hashes) for e in bm.take_events()]
    # A second sequence with the same prompt finds it in the cache.
    again = Sequence("s", list(prompt), len(prompt), SamplingParams(), 1)
    hit = bm.acquire_prefix(again, again.num_tokens - 1)
    return list(seq.block_hashes), events, hit, list(again.block_hashes)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 500), min_size=1, max_size=40),
    st.lists(st.integers(0, 500), max_size=12),
    st.lists(st.integers(1, 9), max_size=6),
)
def test_prompt_hashes_once_are_the_block_by_block_chain(prompt, generated, chunks):
    lazily = run(prompt, generated, chunks, given_hashes=False)
    given_ = run(prompt, generated, chunks, given_hashes=True)
    assert lazily == given_
    hashes, events, hit, hit_hashes = lazily
    expected = chained(prompt + generated)
    assert hashes == expected
    assert [h for kind, hs in events if kind == "stored" for h in hs] == expected
    assert hit == (len(prompt) - 1) // BS * BS
    assert hit_hashes == chained(prompt)[: hit // BS]


def test_a_prompt_tokens_prompt_is_served_as_a_list_is(make_engine):
    prompt = random_prompts([30], seed=5)[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    results = []
    for as_given in (list(prompt), PromptTokens(prompt)):
        events: list = []
        prefill, decode = make_engine(sink=events.extend), make_engine(sink=events.extend)
        tokens, reservation = handoff(prefill, decode, "r", as_given, params)
        # The decode worker now holds the prompt's blocks: a second request hits them.
        decode.add_request("again", as_given, SamplingParams(max_tokens=2, ignore_eos=True))
        while decode.has_unfinished():
            decode.step()
        kv = [(e.kind, tuple(e.block_hashes), e.token_count) for e in events]
        results.append((tokens, reservation, kv, decode.stats()["prefix_hit_tokens"]))
    assert results[0] == results[1]
    assert results[0][3] == 28  # 7 full blocks of the 30-token prompt
