"""The built-in model: a deterministic random-weight Llama written in Hugging Face layout.

`make_model` writes config.json, generation_config.json, model.safetensors and a tokenizer.
`default_model_dir()` creates the tiny preset once in the cache directory and returns it;
it is what every component uses when no model is configured (nothing is ever downloaded).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.config import default_cache_dir
from pdserve.models.presets import preset_config
from pdserve.models.tokenizer_builder import write_tokenizer

if TYPE_CHECKING:
    import torch

# Bump when presets or initialization change, so a stale cached model is not reused.
BUILTIN_VERSION = 2


def random_weights(
    config: dict,
    seed: int,
    dtype: str = "float32",
    device: str = "cpu",
    residual_scale: float = 1.0,
) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors of `dtype`, drawn on `device` (a GPU draws an 8B model's in
    seconds; each device has its own random stream). Scales are chosen so the model is not a
    near-no-op: linear layers keep activations at unit scale (std 1/sqrt(fan_in)), so
    attention visibly shapes the output, and logits have std ~3, so greedy decoding is rarely
    close to a tie (a near tie would make token-for-token comparisons with transformers
    flaky).

    `residual_scale` multiplies the layers' output projections (o_proj, down_proj), what each
    layer adds to the residual stream. At 1 every layer moves the stream as far as the
    embedding put it, so the first layers say nothing of the last ones' prediction; below 1
    (GPT-2 draws them at 1/sqrt(2 * layers)) the stream keeps the embedding and the layers
    refine it, as in a model trained for early exit (LayerSkip): its first layers make a
    self-speculative draft that agrees with it (`make-model --residual-scale`,
    docs/decoding.md). The draws are the same at every scale."""
    import torch  # here, not at the top: finding an existing model must not need torch

    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    ones = partial(torch.ones, dtype=getattr(torch, dtype))

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        drawn = torch.randn(rows, cols, generator=gen, device=device) * std
        return drawn.to(getattr(torch, dtype)).cpu()  # one tensor at a time in float32

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, 1.0 / math.sqrt(in_features))

    def residual(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, residual_scale / math.sqrt(in_features))

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden, 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = residual(hidden, heads * head_dim)
        if "Qwen3MoeForCausalLM" in config["architectures"]:
            tensors[p + "self_attn.q_norm.weight"] = ones(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = ones(head_dim)
        if _num_experts(config):  # every layer sparse (the presets and shapes)
            tensors.update(_experts(config, p, linear, residual))
        else:
            tensors[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
            tensors[p + "mlp.up_proj.weight"] = linear(inter, hidden)
            tensors[p + "mlp.down_proj.weight"] = residual(hidden, inter)
        tensors[p + "input_layernorm.weight"] = ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = ones(hidden)
    tensors["model.norm.weight"] = ones(hidden)
    tensors["lm_head.weight"] = normal(config["vocab_size"], hidden, 3.0 / math.sqrt(hidden))
    return tensors


def _num_experts(config: dict) -> int:
    return config.get("num_experts") or config.get("num_local_experts") or 0


def _experts(config: dict, prefix: str, linear, residual) -> dict[str, torch.Tensor]:
    """A mixture-of-experts layer's router and experts, one tensor per expert as published
    Qwen-MoE checkpoints name them (Mixtral's expert size is its intermediate_size)."""
    hidden = config["hidden_size"]
    inner = config.get("moe_intermediate_size") or config["intermediate_size"]
    tensors = {prefix + "mlp.gate.weight": linear(_num_experts(config), hidden)}
    for e in range(_num_experts(config)):
        p = f"{prefix}mlp.experts.{e}."
        tensors[p + "gate_proj.weight"] = linear(inner, hidden)
        tensors[p + "up_proj.weight"] = linear(inner, hidden)
        tensors[p + "down_proj.weight"] = residual(hidden, inner)
    return tensors


def make_model(directory: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Writes a random-weight model directory; the same (preset, seed) gives the same files."""
    return write_model(directory, preset_config(preset), seed)


def write_model(
    directory: str | Path,
    config: dict,
    seed: int,
    dtype: str = "float32",
    device: str = "cpu",
    residual_scale: float = 1.0,
) -> Path:
    """Writes config.json (with `torch_dtype` = dtype), generation_config.json, random weights
    (`random_weights`) and a tokenizer for `config`."""
    from safetensors.torch import save_file

    out = Path(directory)
    config = {**config, "torch_dtype": dtype}
    out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed, dtype, device, residual_scale)
    save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    write_tokenizer(out, config["vocab_size"])
    return out


def default_model_dir() -> Path:
    """The built-in tiny model, created in the cache directory on first use."""
    return builtin_model_dir("tiny")


def builtin_model_dir(preset: str = "tiny") -> Path:
    """A preset's model (seed 0) in the cache directory, created on first use.

    Safe against several processes doing it at once: each builds in its own temporary
    directory and renames it into place; a loser of the race discards its copy.
    """
    target = default_cache_dir() / "models" / f"{preset}-llama-v{BUILTIN_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-llama-", dir=target.parent))
    try:
        make_model(tmp, preset, seed=0)
        try:
            os.rename(tmp, target)  # atomic; fails if another process got there first
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
