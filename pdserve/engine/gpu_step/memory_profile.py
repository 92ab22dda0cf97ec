"""KV pool size on CUDA from `--gpu-memory-utilization` (as vLLM does): a profiling forward
pass of a full step (max_num_batched_tokens prompt tokens) measures the activation peak; the
arithmetic is `model_limits.gpu_kv_pool_blocks`, and the CUDA calls here are only the
measurements it needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.core import model_limits
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.engine_config import EngineConfig


def kv_pool_blocks(
    hf_config: dict[str, Any],
    config: EngineConfig,
    make_runner: Callable[[int], Any],
) -> int:
    """The pool size: `num_kv_blocks` when given, `--kv-cache-mb` on CPU, else (CUDA) what
    `gpu_memory_utilization` of the device leaves after the weights and a profiled step.
    make_runner(num_blocks): a ModelRunner of the loaded model with that many KV blocks."""
    if config.num_kv_blocks or not config.device.startswith("cuda"):
        return model_limits.kv_pool_blocks(hf_config, config)
    device = torch.device(config.device)
    torch.cuda.synchronize(device)
    # Segments the caching allocator kept from an engine this process dropped (selftest and
    # the benches build several in turn) would read as not free, and could not hold a pool
    # of a slightly different size: hand them back first (seen on an H200: OOM at the second
    # engine, 69.7 GiB reserved but unallocated).
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    activations = _profile_step(make_runner, config, device) - weights
    free, total = torch.cuda.mem_get_info(device)
    per_block = model_limits.kv_bytes_per_block(
        hf_config, config.block_size, config.dtype, config.tp
    )
    return model_limits.gpu_kv_pool_blocks(
        total, config.gpu_memory_utilization, weights, activations, per_block, free
    )


def _profile_step(
    make_runner: Callable[[int], Any], config: EngineConfig, device: torch.device
) -> int:
    """Peak bytes allocated while a full step's prompt (max_num_batched_tokens tokens) runs
    through the model with a KV cache just big enough for it; that cache is not counted."""
    tokens = config.max_num_batched_tokens
    num_blocks = -(-tokens // config.block_size)
    runner = make_runner(num_blocks)
    cache_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    seq = Sequence("memory-profile", [0] * tokens, tokens, SamplingParams(max_tokens=1), 0)
    seq.block_table = list(range(num_blocks))
    batch = ScheduledBatch()
    batch.add(seq, tokens)
    torch.cuda.reset_peak_memory_stats(device)
    runner.run(batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes
    del runner
    torch.cuda.empty_cache()
    return peak
