"""DraftProposer: its proposals are the draft model's own greedy continuation (an LLMEngine on
the draft directory), whatever its KV cache went through: batching, rejected drafts, forks and
copy-on-write, prefix-cache hits, preemption, blocks another sequence overwrote."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve.config import ConfigError
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculation.draft_model_proposer import DraftProposer
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.draft_of import write_draft_of
from tests.engine.conftest import random_prompts

BLOCK = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tiny_dir, tmp_path_factory):
    return write_draft_of(tiny_dir, tmp_path_factory.mktemp("draft"), 1)[0]


@pytest.fixture(scope="module")
def reference(draft_dir):
    """reference(tokens, k): the draft model's greedy continuation, from its own engine."""
    engine = LLMEngine(EngineConfig(model=str(draft_dir), block_size=BLOCK, num_kv_blocks=256))

    def continuation(tokens: list[int], k: int) -> list[int]:
        params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        return engine.generate([tokens], params)[0]

    return continuation


@pytest.fixture
def proposer(tiny_dir, draft_dir):
    spec = SpeculativeConfig(method="draft", draft_model=str(draft_dir))
    config = EngineConfig(model=str(tiny_dir), block_size=BLOCK, speculative=spec)
    return DraftProposer(config, NUM_BLOCKS)


@pytest.fixture
def blocks():
    return BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)


def running(blocks: BlockManager, tokens: list[int], k: int, params=GREEDY) -> Sequence:
    """A decode sequence as the engine hands it to a proposer: every token but the last
    computed, its block table grown for k drafts."""
    seq = Sequence(f"r{id(tokens)}", list(tokens), len(tokens), params, arrival=0)
    grow(blocks, seq, k)
    return seq


def grow(blocks: BlockManager, seq: Sequence, k: int) -> None:
    assert blocks.ensure_blocks(seq, seq.num_tokens + k - 1)
    seq.num_computed_tokens = seq.num_tokens - 1


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_proposals_are_the_drafts_greedy_continuation(proposer, blocks, reference, k):
    prompts = random_prompts([1, 6, 13, 30], seed=k)
    seqs = [running(blocks, p, k) for p in prompts]
    assert proposer.propose(seqs, k) == [reference(p, k) for p in prompts]
    assert proposer.draft_probs() == [None] * len(prompts)


def test_accepted_drafts_keep_their_kv_and_rejected_ones_are_recomputed(
    proposer, blocks, reference
):
    k = 4
    gen = torch.Generator().manual_seed(1)
    seq = running(blocks, random_prompts([9])[0], k)
    for _ in range(8):
        proposal = proposer.propose([seq], k)[0]
        assert proposal == reference(seq.token_ids, k)
        accepted = int(torch.randint(0, k + 1, (1,), generator=gen))
        correction = (proposal[accepted] + 1) % 512 if accepted < k else 7
        before = seq.num_tokens
        seq.token_ids += proposal[:accepted] + [correction]
        # The last token and the accepted drafts have draft KV; the correction has none.
        assert proposer.valid_tokens(seq) == before + min(accepted, k - 1)
        grow(blocks, seq, k)


def test_a_batch_with_a_sequence_that_has_no_room(proposer, blocks, reference):
    prompts = random_prompts([5, 8], seed=3)
    seqs = [running(blocks, p, 4) for p in prompts]
    seqs[1].block_table = seqs[1].block_table[:2]  # 8 tokens fill it: room for one draft
    assert proposer.propose(seqs, 4) == [reference(prompts[0], 4), reference(prompts[1], 1)]


def test_forks_sharing_a_block_wait_for_copy_on_write(proposer, blocks, reference):
    prompt = random_prompts([10], seed=4)[0]  # 2 full blocks and a shared partial one
    parent = running(blocks, prompt, 4)
    child = Sequence("child", list(prompt), len(prompt), GREEDY, arrival=1)
    blocks.fork(parent, child)
    parent.token_ids.append(11)
    child.token_ids.append(12)
    for seq in (parent, child):
        grow(blocks, seq, 4)
    assert proposer.propose([parent, child], 4) == [reference(parent.token_ids, 4), []]
    copies = blocks.copy_on_write(child, 8, child.num_tokens + 3)
    assert copies
    proposer.copy_blocks(copies)
    assert proposer.valid_tokens(child) == 10  # the prompt's draft KV came with the copy
    assert proposer.propose([parent, child], 4) == [
        reference(parent.token_ids, 4),
        reference(child.token_ids, 4),
    ]


def test_a_prefix_cache_hit_reuses_the_draft_kv(proposer, blocks, reference):
    prompt = random_prompts([14], seed=5)[0]
    first = running(blocks, prompt, 2)
    assert proposer.propose([first], 2) == [reference(prompt, 2)]
    first.num_computed_tokens = first.num_tokens
    blocks.cache_full_blocks(first)
    second = Sequence("second", prompt[:12] + [99, 98], 14, GREEDY, arrival=1)
    assert blocks.acquire_prefix(second, second.num_tokens) == 12
    grow(blocks, second, 2)
    assert proposer.valid_tokens(second) == 12
    assert proposer.propose([second], 2) == [reference(second.token_ids, 2)]


def test_preempted_sequence_recomputes_into_its_new_blocks(proposer, blocks, reference):
    seq = running(blocks, random_prompts([11], seed=6)[0], 4)
    assert proposer.propose([seq], 4) == [reference(seq.token_ids, 4)]
    proposer.forget(seq)
    old = list(seq.block_table)
    blocks.release(seq)
    seq.block_table = old[::-1]  # readmitted into blocks that held other positions
    assert proposer.valid_tokens(seq) == 0
    assert proposer.propose([seq], 4) == [reference(seq.token_ids, 4)]


def test_a_block_another_sequence_overwrote_is_recomputed(proposer, blocks, reference):
    a = running(blocks, random_prompts([10], seed=7)[0], 2)
    assert proposer.propose([a], 2) == [reference(a.token_ids, 2)]
    b = Sequence("b", random_prompts([6], seed=8)[0], 6, GREEDY, arrival=1)
    b.block_table = [a.block_table[1], a.block_table[0]]  # a's blocks, other tokens
    b.num_computed_tokens = 5
    assert proposer.propose([b], 2) == [reference(b.token_ids, 2)]
    assert proposer.valid_tokens(a) == 0
    assert proposer.propose([a], 2) == [reference(a.token_ids, 2)]


def test_the_same_tokens_after_another_prefix_are_recomputed(proposer, blocks, reference):
    a = running(blocks, random_prompts([10], seed=10)[0], 2)
    assert proposer.propose([a], 2) == [reference(a.token_ids, 2)]
    # b's first block holds the tokens of a's second block: same tokens, other position and
    # context, so other KV.
    b = Sequence("b", a.token_ids[4:8] + [5, 6], 6, GREEDY, arrival=1)
    b.block_table = [a.block_table[1], *blocks_for(blocks, 1)]
    b.num_computed_tokens = 5
    assert proposer.valid_tokens(b) == 0
    assert proposer.propose([b], 2) == [reference(b.token_ids, 2)]


def blocks_for(blocks: BlockManager, n: int) -> list[int]:
    holder = Sequence("holder", [0], 1, GREEDY, arrival=9)
    assert blocks.ensure_blocks(holder, n * BLOCK)
    return holder.block_table


def test_sampled_drafts_return_q_and_seeded_ones_reproduce(tiny_dir, draft_dir, blocks):
    spec = SpeculativeConfig(method="draft", draft_model=str(draft_dir))
    config = EngineConfig(model=str(tiny_dir), block_size=BLOCK, speculative=spec)
    prompt = random_prompts([7], seed=9)[0]
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=5)
    runs = []
    for _ in range(2):
        proposer = DraftProposer(config, NUM_BLOCKS)
        seqs = [running(blocks, prompt, 4, seeded), running(blocks, prompt, 4)]
        runs.append(proposer.propose(seqs, 4))
        q, greedy_q = proposer.draft_probs()
        assert greedy_q is None
        assert q.shape == (4, 512)
        assert torch.allclose(q.sum(-1), torch.ones(4))
        assert ((q > 0).sum(-1) <= 20).all()  # top-k filtered
        assert all(q[i, token] > 0 for i, token in enumerate(runs[-1][0]))
    assert runs[0] == runs[1]


def test_a_draft_with_another_vocabulary_is_refused(tiny_dir, draft_dir, tmp_path):
    other = shutil.copytree(draft_dir, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, vocab_size=1024)))
    spec = SpeculativeConfig(method="draft", draft_model=str(other))
    with pytest.raises(ConfigError, match="draft_model.*vocabulary of 1024 tokens, the target 512"):
        DraftProposer(EngineConfig(model=str(tiny_dir), speculative=spec), NUM_BLOCKS)
