"""Rotary position embedding tables, computed exactly as transformers' ROPE_INIT_FUNCTIONS do.

Supported `rope_type`s: default, linear, dynamic, yarn, llama3. `dynamic` (NTK) rescales only
for sequences longer than max_position_embeddings; the engine never runs those (max_model_len
is capped by max_position_embeddings and the tables end there), so its tables are the default
ones. yarn also scales cos/sin by an attention factor, which `rope_tables` applies.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_tables(
    head_dim: int, max_positions: int, rope: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [max_positions, head_dim] float32
    """cos/sin over every position, float32 like transformers (the model casts at use)."""
    inv_freq, attention_factor = _inv_freq(head_dim, rope)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def _inv_freq(head_dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the factor cos/sin are multiplied by."""
    base = float(rope["rope_theta"])
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponent)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / rope["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, base, rope)
    return inv_freq, 1.0  # default, and dynamic within max_position_embeddings


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(head_dim: int, base: float, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between."""
    old_len = rope["original_max_position_embeddings"]
    factor = rope["factor"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # keeps the ramp finite
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
