"""What `bench kv-tiers`' and `bench peer-pull`'s tests check alike of the multi-turn chat."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.serving.multi_turn_chat import chat_requests, minimum_prefill_tokens

# The chat at its smallest: a few short conversations sharing two system prompts.
SMALLEST_CHAT = {
    "conversations": 4,
    "turns": 3,
    "system_prompts": 2,
    "system_prompt_len": 64,
    "user_len": 32,
    "output_len": 4,
}


def check_each_way_served_the_chat(
    document: dict, ways: tuple[str, ...], args: argparse.Namespace
) -> None:
    """Each way's row in a bench's --json: every request completed, and its token counts and
    TTFT agree with the chat's prompts."""
    from pdserve.bench.common.local_system import load_model

    _, model_config = load_model(args)
    prompts = [r.prompt for r in chat_requests(args, model_config)]
    for way in ways:
        r = document[way]
        assert r["failed"] == 0 and r["completed"] == len(prompts)
        assert r["prompt_tokens"] == sum(len(p) for p in prompts)
        # Every prompt token is either computed or found in a cache, any tier or pulled.
        assert r["computed_tokens"] + r["hit_tokens"] == r["prompt_tokens"]
        assert r["minimum_tokens"] == minimum_prefill_tokens(prompts, args.block_size)
        assert r["computed_vs_minimum"] == pytest.approx(r["computed_tokens"] / r["minimum_tokens"])
        assert r["ttft_p50_ms"] > 0
