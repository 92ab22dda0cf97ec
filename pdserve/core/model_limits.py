"""The context length a deployment serves, from the model's config.json and the EngineConfig.

The engine sizes itself with these functions and the router validates requests against the
same `max_model_len`, so a request the router accepts always fits the engine. The engine runs
full causal attention; on a sliding-window model (Mistral, Mixtral, Qwen2/3 and their MoE
variants with `use_sliding_window`) that equals the model's own attention only while the
sequence fits the window, so the window caps the context too.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine_config import EngineConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048


_QWEN_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


def sliding_window(hf_config: dict[str, Any]) -> int | None:
    """Mistral/Qwen2/Qwen3 sliding window in tokens, or None when attention is over everything.
    Qwen2 and Qwen3 slide only with use_sliding_window, and only in layers from
    max_window_layers on."""
    architectures = hf_config.get("architectures", [])
    if any(a in architectures for a in _QWEN_ARCHITECTURES):
        sliding_layers = hf_config["num_hidden_layers"] - hf_config.get("max_window_layers", 0)
        if not hf_config.get("use_sliding_window", False) or sliding_layers <= 0:
            return None
    return hf_config.get("sliding_window") or None


def kv_bytes_per_block(hf_config: dict[str, Any], block_size: int, dtype: str, tp: int = 1) -> int:
    """Bytes of one KV block over all layers (K and V) on one of `tp` tensor-parallel ranks:
    its share of the KV heads, at least one (tp_layout.py replicates them past that)."""
    heads = hf_config["num_attention_heads"]
    kv_heads = max((hf_config.get("num_key_value_heads") or heads) // tp, 1)
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    layers = hf_config["num_hidden_layers"]
    return layers * 2 * block_size * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_pool_blocks(hf_config: dict[str, Any], engine: EngineConfig) -> int:
    """The KV pool size in blocks: `num_kv_blocks`, else as many as `kv_cache_bytes` holds
    (per tensor-parallel rank: each holds its own heads' pool of that size).
    (A CUDA worker without num_kv_blocks sizes its pool from measured memory instead:
    gpu_kv_pool_blocks, pdserve/engine/gpu_step/memory_profile.py.)"""
    if engine.num_kv_blocks:
        return engine.num_kv_blocks
    per_block = kv_bytes_per_block(hf_config, engine.block_size, engine.dtype, engine.tp)
    return engine.kv_cache_bytes // per_block


def tensor_parallel_error(heads: int, kv_heads: int, intermediate: int, tp: int) -> str | None:
    """Why `tp` ranks cannot split a model with these head and MLP sizes (one line naming the
    numbers), or None when they can."""
    if tp < 1:
        return f"tensor parallel degree must be at least 1, got {tp}"
    if heads % tp:
        return f"tensor parallel degree {tp} does not divide num_attention_heads {heads}"
    if kv_heads % tp and tp % kv_heads:
        return (
            f"tensor parallel degree {tp} and num_key_value_heads {kv_heads}: neither divides "
            "the other, so some rank's query heads would need two KV heads"
        )
    if intermediate % tp:
        return f"tensor parallel degree {tp} does not divide intermediate_size {intermediate}"
    return None


def check_tensor_parallel(hf_config: dict[str, Any], tp: int) -> None:
    """ValueError (one line naming the numbers) when `tp` ranks cannot split this model
    (pdserve/models/tp_layout.py)."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    problem = tensor_parallel_error(heads, kv_heads, hf_config["intermediate_size"], tp)
    if problem:
        raise ValueError(problem)


def gpu_kv_pool_blocks(
    total_bytes: int,
    utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    bytes_per_block: int,
    free_bytes: int | None = None,
) -> int:
    """KV pool blocks on a GPU, as vLLM sizes it: the share `utilization` of the device's
    memory, less the model weights and the activation peak of a profiling forward pass of a
    full step (max_num_batched_tokens); what is left is KV cache. `free_bytes`, what the
    device has free now (weights loaded, profiling freed): the pool must fit in it, since
    memory other processes hold is not ours to count on. Raises ValueError when nothing is
    left, or when the pool does not fit."""
    free = int(total_bytes * utilization) - weights_bytes - activation_peak_bytes
    if free < bytes_per_block:
        raise ValueError(
            f"gpu_memory_utilization {utilization} of {total_bytes / 2**30:.1f} GiB leaves "
            f"{max(free, 0) / 2**20:.0f} MiB after the weights ({weights_bytes / 2**20:.0f} MiB) "
            f"and activations ({activation_peak_bytes / 2**20:.0f} MiB): no room for a KV block"
        )
    # The activation peak must still fit beside the pool once serving starts.
    if free_bytes is not None and free + activation_peak_bytes > free_bytes:
        raise ValueError(
            f"gpu_memory_utilization {utilization} asks for a {free / 2**30:.1f} GiB KV pool "
            f"(+ {activation_peak_bytes / 2**30:.1f} GiB of activations) but the device has "
            f"only {free_bytes / 2**30:.1f} GiB free: other processes hold memory on it; "
            "lower gpu_memory_utilization"
        )
    return free // bytes_per_block


def max_model_len(hf_config: dict[str, Any], engine: EngineConfig) -> int:
    """Longest sequence (prompt + generated tokens) one request may reach.

    The smallest of: `engine.max_model_len` (else the model's max_position_embeddings), the
    KV pool (a sequence that can never fit would be preempted forever) and the sliding window.
    Raises ValueError when the settings cannot serve any request.
    """
    model_len = hf_config.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS)
    if engine.max_model_len and engine.max_model_len > model_len:
        raise ValueError(f"max_model_len {engine.max_model_len} > the model's {model_len}")
    blocks = kv_pool_blocks(hf_config, engine)
    if blocks < 1:
        raise ValueError("the KV cache must hold at least one block")
    limits = [engine.max_model_len or model_len, blocks * engine.block_size]
    window = sliding_window(hf_config)
    return min(limits + ([window] if window else []))
