"""A multi-turn chat whose prefixes overflow the device KV pool gives the same greedy tokens as
transformers with and without the host tier; with it, evicted prefixes come back from host
memory instead of being recomputed, and the statistics count each tier's hits."""

from __future__ import annotations

import pytest

from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts
from tests.models.hf_reference import hf_greedy

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
CONVERSATIONS, TURNS = 4, 3
DEVICE_BLOCKS = 24  # 96 tokens: about one conversation; the working set is 4 of them


def chat(engine) -> list[tuple[list[int], list[int]]]:
    """Turns taken round-robin over the conversations, each turn's prompt the conversation so
    far plus a new user message: every conversation's prefix is evicted between its turns."""
    history = random_prompts([40] * CONVERSATIONS, seed=3)
    messages = random_prompts([9] * (CONVERSATIONS * TURNS), seed=4)
    transcript = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            prompt = history[c] + messages[turn * CONVERSATIONS + c]
            (output,) = engine.generate([prompt], GREEDY)
            transcript.append((prompt, output))
            history[c] = prompt + output
    return transcript


@pytest.fixture(scope="module")
def budget_gb(tiny_dir):
    """Host memory for 200 blocks of the tiny model."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig

    probe = LLMEngine(EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=1))
    return 200 * probe.bytes_per_block / 2**30


def test_multi_turn_chat_is_exact_and_reuses_host_blocks(make_engine, hf_tiny, budget_gb):
    without = make_engine(num_kv_blocks=DEVICE_BLOCKS)
    tiered = make_engine(num_kv_blocks=DEVICE_BLOCKS, kv_offload_gb=budget_gb)
    plain = chat(without)
    with_tier = chat(tiered)
    assert with_tier == plain
    prompts = [prompt for prompt, _ in with_tier]
    assert [output for _, output in with_tier] == hf_greedy(hf_tiny, prompts, MAX_TOKENS)

    stats, base = tiered.stats(), without.stats()
    assert stats["num_host_blocks"] == 200
    assert 0 < stats["num_host_cached_blocks"] <= 200
    assert stats["host_copy_bytes_per_s"] > 0  # measured when the pool was made
    assert stats["host_restored_blocks"] * 4 == stats["prefix_host_hit_tokens"] > 0
    assert "prefix_host_hit_tokens" in base and base["prefix_host_hit_tokens"] == 0
    # Every later turn finds its whole conversation so far: only the new message, the last
    # full block's remainder and the output are computed.
    assert stats["prefix_hit_tokens"] > base["prefix_hit_tokens"]
    assert stats["prefill_tokens_computed"] < base["prefill_tokens_computed"]


def test_a_tier_too_small_for_the_chat_is_still_exact(make_engine, budget_gb):
    """Five host blocks: the host evicts constantly, yet nothing served changes."""
    without = make_engine(num_kv_blocks=DEVICE_BLOCKS)
    tiered = make_engine(num_kv_blocks=DEVICE_BLOCKS, kv_offload_gb=budget_gb * 5 / 200)
    assert chat(tiered) == chat(without)
    assert tiered.stats()["num_host_cached_blocks"] <= 5
