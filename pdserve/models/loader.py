"""Loads a Hugging Face model directory (config.json + safetensors) into LlamaForCausalLM.

Supported: LlamaForCausalLM (Llama 1-3, rope scaling default/linear/llama3), MistralForCausalLM
and Qwen2ForCausalLM (qkv bias, tied embeddings). Anything else fails with a ModelLoadError
that names the directory and what is missing or unsupported; nothing is ever downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.models.llama import LlamaConfig, LlamaForCausalLM

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# Checkpoint names (per layer) fused into one of our parameters, in concatenation order.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj", "mlp.up_proj"),
}


class ModelLoadError(ValueError):
    """The model directory is missing something or uses something this engine does not run."""


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of `model_dir`, checked to describe a model this engine supports."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"missing config.json in {model_dir}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"config.json in {model_dir} is not valid JSON: {e}") from e
    architectures = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelLoadError(
            f"unsupported architecture {architectures or '(none listed)'} in {path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    missing = [k for k in _REQUIRED_KEYS if k not in config]
    if missing:
        raise ModelLoadError(f"config.json in {model_dir} lacks {', '.join(missing)}")
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {config['hidden_act']!r} in {path}")
    rope_type = rope_parameters(config).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_type {rope_type!r} in {path}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return config


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either layout: transformers 5 `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


def llama_config(config: dict[str, Any]) -> LlamaConfig:
    """Our model config from a validated HF config.json dict."""
    heads = config["num_attention_heads"]
    rope = rope_parameters(config)
    is_qwen2 = "Qwen2ForCausalLM" in config.get("architectures", [])
    return LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope,
        qkv_bias=is_qwen2 or bool(config.get("attention_bias", False)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def sliding_window(config: dict[str, Any]) -> int | None:
    """Mistral/Qwen2 sliding window, or None. The engine caps max_model_len to it, so full
    attention over the context is exactly what the model would compute."""
    if "Qwen2ForCausalLM" in config.get("architectures", []) and not config.get(
        "use_sliding_window", False
    ):
        return None
    return config.get("sliding_window") or None


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"shards listed in {index} are missing: {', '.join(absent)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
    )


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


def load_model(
    model_dir: str | Path, dtype: str = "float32", device: str = "cpu"
) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """The model with its weights, in eval mode, and its config.json dict."""
    model_dir = Path(model_dir)
    hf_config = read_config(model_dir)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    config = llama_config(hf_config)
    tensors = _read_tensors(_weight_files(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name, param in model.named_parameters():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        parts = _checkpoint_parts(name)
        found = [tensors.get(p) for p in parts]
        if any(t is None for t in found):
            missing += [p for p, t in zip(parts, found, strict=True) if t is None]
            continue
        tensor = torch.cat(found, dim=0) if len(found) > 1 else found[0]
        if tensor.shape != param.shape:
            raise ModelLoadError(
                f"{name} in {model_dir} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(param.shape)}"
            )
        state[name] = tensor.to(DTYPES[dtype])
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"weights missing from {model_dir}: {shown}")
    model.to_empty(device=device).to(DTYPES[dtype])
    model.load_state_dict(state, strict=False, assign=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope(device)
    return model.eval(), hf_config


def _checkpoint_parts(name: str) -> list[str]:
    """Checkpoint tensor names (without the `model.` prefix) that make up our parameter."""
    if name == "lm_head.weight":
        return ["lm_head.weight"]
    if name.startswith("layers."):
        index, local = name.split(".", 2)[1:]
        if local in _FUSED:
            suffix = local.rsplit(".", 1)[1]
            return [f"layers.{index}.{part}.{suffix}" for part in _FUSED[local]]
    return [name]
