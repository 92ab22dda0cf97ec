"""Fused CPU ops for a decoder layer's small steps (csrc/fused_ops.cpp, built with the
decode-attention kernel by native_attention.py): the RMSNorm, the residual add with the norm
after it, SiLU(gate) * up, and RoPE with the store of the new keys and values.

Written out in torch, each of these is several eager ops, and a batch-32 decode step of a small
model on CPU ran about 300 of them, whose dispatch and Python cost more than their arithmetic
(BENCHMARKS.md, issue 19). Each op here is one pass over the rows, rounding where the torch
formula rounds (after each op, to the dtype), so bfloat16 results are the formula's up to the
float32 math's own rounding order.

Used only where plain torch would run eagerly on CPU without autograd (`applies`): compiled
graphs, GPUs and training keep the torch formulas (llama.py). `PDSERVE_NATIVE_ATTENTION=0`
turns them off with the kernel.
"""

from __future__ import annotations

import torch

from pdserve.models import native_attention

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The ops below run once the library is loaded: after `applies` (or native_attention.enabled())
# returned True.


def applies(x: torch.Tensor) -> bool:
    """Whether a forward pass over activations `x` takes the fused ops: an eager CPU pass
    without autograd, in a dtype they serve, with the library built."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and native_attention.enabled()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x.float()).to(x.dtype) over the last dimension (weight: x's dtype)."""
    return torch.ops.pdserve_native.rms_norm.default(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta, weight, eps)) in one pass."""
    return torch.ops.pdserve_native.add_rms_norm.default(x, delta, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up, gate and up the two halves of gate_up's last dimension."""
    return torch.ops.pdserve_native.silu_and_mul.default(gate_up)


def rope_store_kv(
    qkv: torch.Tensor,  # [T, (H + 2 * KV) * D]: q, k, v heads (llama.Attention's fused output)
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_positions, D] float32
    sin_signed: torch.Tensor,  # [max_positions, D] float32, first half negated (apply_rope)
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D], written at slot_mapping
    slot_mapping: torch.Tensor,  # [T] int64
    num_heads: int,
) -> torch.Tensor:  # [T, H, D]
    """llama.apply_rope on the q and k heads at each token's position; the rotated keys and the
    values stored in their slots of layer_cache (as attention.store_kv), the queries returned."""
    return torch.ops.pdserve_native.rope_store_kv.default(
        qkv, positions, cos, sin_signed, layer_cache, slot_mapping, num_heads
    )
