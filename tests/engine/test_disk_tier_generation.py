"""The multi-turn chat of test_host_tier_generation with a host tier too small for it and a disk
tier under it: the same greedy tokens as without tiers and as transformers; evicted prefixes
come back from disk, and the statistics count the hits of each tier."""

from __future__ import annotations

import pytest

from pdserve.config_fields import ConfigError
from pdserve.engine_config import EngineConfig
from tests.engine.test_host_tier_generation import DEVICE_BLOCKS, MAX_TOKENS, budget_gb, chat
from tests.models.hf_reference import hf_greedy

__all__ = ["budget_gb"]  # the fixture: host memory for 200 blocks


def test_multi_turn_chat_is_exact_and_reuses_disk_blocks(make_engine, hf_tiny, budget_gb, tmp_path):
    without = make_engine(num_kv_blocks=DEVICE_BLOCKS)
    tiered = make_engine(
        num_kv_blocks=DEVICE_BLOCKS,
        kv_offload_gb=budget_gb * 5 / 200,  # 5 host blocks: most evictions reach the disk
        kv_disk_dir=str(tmp_path),
        kv_disk_gb=budget_gb,
    )
    plain = chat(without)
    with_tiers = chat(tiered)
    assert with_tiers == plain
    prompts = [prompt for prompt, _ in with_tiers]
    assert [output for _, output in with_tiers] == hf_greedy(hf_tiny, prompts, MAX_TOKENS)

    stats, base = tiered.stats(), without.stats()
    assert stats["num_host_blocks"] == 5 and 0 < stats["num_disk_blocks"] < 200  # headers
    assert stats["disk_restored_blocks"] * 4 == stats["prefix_disk_hit_tokens"] > 0
    assert stats["host_restored_blocks"] * 4 == stats["prefix_host_hit_tokens"]
    assert stats["disk_read_bytes_per_s"] > 0 and stats["disk_write_failures"] == 0
    assert base["prefix_disk_hit_tokens"] == 0 and base["num_disk_blocks"] == 0
    assert stats["prefill_tokens_computed"] < base["prefill_tokens_computed"]
    tiered.close()  # the writer thread stops; no temporary file is left
    assert not list(tmp_path.rglob("*.tmp")) and list(tmp_path.rglob("*.kv"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_disk_gb": 1.0, "kv_offload_gb": 1.0}, "needs --kv-disk-dir"),
        ({"kv_disk_gb": 1.0, "kv_disk_dir": "/tmp/x"}, "needs --kv-offload-gb"),
    ],
)
def test_a_disk_tier_needs_a_directory_and_a_host_tier(fields, message):
    with pytest.raises(ConfigError, match=message) as raised:
        EngineConfig(**fields)
    assert "kv_disk_gb" in str(raised.value)
