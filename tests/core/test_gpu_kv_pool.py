"""KV pool sizing: on CUDA from --gpu-memory-utilization (the arithmetic, with given numbers),
on CPU from --kv-cache-mb bytes (a real engine)."""

from __future__ import annotations

import pytest

from pdserve.core import model_limits
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import make_model

GiB, MiB = 2**30, 2**20


def test_pool_is_utilization_share_less_weights_and_activations():
    # 80 GiB at 0.9 = 72 GiB; less 16 GiB of weights and 2 GiB of activations = 54 GiB.
    blocks = model_limits.gpu_kv_pool_blocks(80 * GiB, 0.9, 16 * GiB, 2 * GiB, 2 * MiB)
    assert blocks == int(80 * GiB * 0.9 - 18 * GiB) // (2 * MiB)
    # A partial block does not count.
    assert model_limits.gpu_kv_pool_blocks(10 * MiB, 1.0, 0, 1 * MiB, 2 * MiB) == 4


def test_no_room_for_a_block_names_the_setting():
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.5"):
        model_limits.gpu_kv_pool_blocks(16 * GiB, 0.5, 7 * GiB, 2 * GiB, 2 * MiB)


def test_a_pool_that_does_not_fit_in_free_memory_is_refused():
    # 54 GiB of pool + 2 GiB of activations asked for, but another process holds memory: only
    # 40 GiB are free.
    with pytest.raises(ValueError, match="only 40.0 GiB free"):
        model_limits.gpu_kv_pool_blocks(80 * GiB, 0.9, 16 * GiB, 2 * GiB, 2 * MiB, 40 * GiB)
    fits = model_limits.gpu_kv_pool_blocks(80 * GiB, 0.9, 16 * GiB, 2 * GiB, 2 * MiB, 56 * GiB)
    assert fits == int(80 * GiB * 0.9 - 18 * GiB) // (2 * MiB)


def test_utilization_must_be_a_share():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0)


def test_cpu_pool_comes_from_bytes(tmp_path):
    model_dir = make_model(tmp_path, "tiny", seed=0)
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_bytes=8 * MiB))
    per_block = engine.bytes_per_block
    assert engine.stats()["num_blocks"] == 8 * MiB // per_block
