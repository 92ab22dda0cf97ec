"""A Hugging Face config.json -> our LlamaConfig. Every field that changes the model's math is
either honoured exactly as transformers does or refused with a ModelLoadError naming it.

Honoured: vocab/hidden/intermediate sizes, layers, heads, num_key_value_heads, head_dim,
rms_norm_eps, tie_word_embeddings, hidden_act (see llama.ACTIVATIONS), rope_theta and
rope_parameters / rope_scaling (see rope.ROPE_TYPES), Llama's and Qwen3's attention_bias (q, k,
v and o), Llama's mlp_bias, Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm. Sliding windows
(Mistral, Qwen2/Qwen3 use_sliding_window / max_window_layers) cap the context instead
(pdserve.core.model_limits).
Mixtures of experts (moe.py): Qwen3-MoE and Qwen2-MoE's num_experts (or num_local_experts),
num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
mlp_only_layers, Qwen2-MoE's qkv_bias and shared expert (shared_expert_intermediate_size);
Mixtral's num_local_experts and num_experts_per_tok (always renormalized), with transformers'
defaults for each architecture.
Refused: quantization_config, num_attention_heads not a multiple of num_key_value_heads,
other rope types, rope_parameters per layer type, partial_rotary_factor != 1, routing this
engine does not implement (`_UNIMPLEMENTED_ROUTING`: DeepSeek-style grouped or biased top-k,
scaled or sigmoid scores, other shared-expert layouts), and leaving unset a key whose
transformers default is architecture-specific (`_MUST_BE_SET`).
Fields without effect on inference (dropout, initializer_range, pretraining_tp, use_cache,
output_router_logits, router_aux_loss_coef, router_jitter_noise) are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.models.llama import ACTIVATIONS, LlamaConfig
from pdserve.models.moe import MoeConfig
from pdserve.models.rope import ROPE_TYPES

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
# rope_parameters keys each rope type needs (original_max_position_embeddings has a default).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
}

# Keys whose transformers default for that architecture (Mistral: 4096-token sliding window,
# 8 KV heads; Qwen2: 32 KV heads; Qwen3: 32 KV heads, head_dim 128) differs from what their
# absence means for Llama.
_MUST_BE_SET = {
    "MistralForCausalLM": ("sliding_window", "num_key_value_heads"),
    "Qwen2ForCausalLM": ("num_key_value_heads",),
    "Qwen3ForCausalLM": ("num_key_value_heads", "head_dim"),
    "Qwen2MoeForCausalLM": ("num_key_value_heads",),
    "Qwen3MoeForCausalLM": ("num_key_value_heads",),
    "MixtralForCausalLM": ("num_key_value_heads",),
}
# transformers' defaults of the mixture-of-experts fields, per architecture (its config classes).
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen2MoeForCausalLM": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
    },
    "Qwen3MoeForCausalLM": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
    },
    "MixtralForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2},
}
# Routing and expert layouts of other MoE families (DeepSeek-V2/V3, Llama 4, GLM-4.5, ...) that
# would change the math if present: refused by name rather than silently run as softmax top-k.
_UNIMPLEMENTED_ROUTING = (
    "topk_method",
    "e_score_correction_bias",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "scoring_func",
    "n_shared_experts",
    "moe_layer_freq",
    "first_k_dense_replace",
    "interleave_moe_layer_step",
    "router_bias",
    "num_shared_experts",
)


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
    architecture(config, path)
    missing = [k for k in _REQUIRED_KEYS if k not in config]
    if missing:
        raise ModelLoadError(f"config.json in {model_dir} lacks {', '.join(missing)}")
    llama_config(config, path)  # refuses what the model cannot compute
    return config


def architecture(config: dict[str, Any], path: Path | str = "config.json") -> str:
    """The first supported entry of `architectures`."""
    listed = config.get("architectures") or []
    for name in listed:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ModelLoadError(
        f"unsupported architecture {listed or '(none listed)'} in {path}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def rope_parameters(config: dict[str, Any], path: Path | str = "config.json") -> dict[str, Any]:
    """RoPE settings from either layout (transformers 5 `rope_parameters`, or the older
    top-level `rope_theta` + `rope_scaling`), with transformers' defaults filled in."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:
        raise ModelLoadError(f"unsupported rope_parameters per layer type {nested} in {path}")
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_type {rope_type!r} in {path}; supported: {', '.join(ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"unsupported partial_rotary_factor {partial} in {path}")
    if rope_type in ("llama3", "yarn"):
        # A top-level value wins over the one inside the rope parameters, as in transformers.
        top_level = config.get("original_max_position_embeddings")
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = (
            config["max_position_embeddings"] / params["original_max_position_embeddings"]
        )
    absent = [k for k in _ROPE_REQUIRED.get(rope_type, ()) if params.get(k) is None]
    if absent:
        raise ModelLoadError(
            f"rope_type {rope_type!r} in {path} needs rope_parameters {', '.join(absent)}"
        )
    return params


def llama_config(config: dict[str, Any], path: Path | str = "config.json") -> LlamaConfig:
    """Our model config from a config.json dict; ModelLoadError for what it cannot express."""
    arch = architecture(config, path)
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act not in ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported hidden_act {hidden_act!r} in {path}; supported: {', '.join(ACTIVATIONS)}"
        )
    unset = [k for k in _MUST_BE_SET.get(arch, ()) if k not in config]
    if unset:
        raise ModelLoadError(
            f"{path} must set {', '.join(unset)} for {arch}: transformers' default "
            "differs from the Llama one the rest of pdserve assumes"
        )
    if config.get("quantization_config"):
        raise ModelLoadError(f"unsupported quantization_config in {path}: weights must be dense")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelLoadError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
            f"in {path}"
        )
    is_llama = arch == "LlamaForCausalLM"
    is_qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    # Llama and Qwen3 read attention_bias, only Llama mlp_bias; Qwen2 always has q/k/v bias
    # and nothing else, Qwen2-MoE as its qkv_bias says.
    attention_bias = (is_llama or is_qwen3) and bool(config.get("attention_bias", False))
    qkv_bias = arch == "Qwen2ForCausalLM" or (
        arch == "Qwen2MoeForCausalLM" and bool(config.get("qkv_bias", True))
    )
    return LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_parameters=rope_parameters(config, path),
        qkv_bias=attention_bias or qkv_bias,
        o_proj_bias=attention_bias,
        mlp_bias=is_llama and bool(config.get("mlp_bias", False)),
        hidden_act=hidden_act,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=is_qwen3,
        moe=moe_config(config, path) if arch in _MOE_DEFAULTS else None,
    )


def moe_config(config: dict[str, Any], path: Path | str = "config.json") -> MoeConfig:
    """The mixture-of-experts sizes and routing of a Qwen2-MoE, Qwen3-MoE or Mixtral config;
    ModelLoadError naming a routing field this engine does not implement."""
    arch = architecture(config, path)
    unknown = [k for k in _UNIMPLEMENTED_ROUTING if config.get(k) is not None]
    if unknown:
        raise ModelLoadError(
            f"unsupported mixture-of-experts routing {', '.join(unknown)} in {path}: this "
            f"engine runs {arch}'s softmax top-k routing only"
        )
    c = {**_MOE_DEFAULTS[arch], **{k: v for k, v in config.items() if v is not None}}
    experts = int(c.get("num_local_experts", c["num_experts"]))
    top_k = int(c["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"num_experts_per_tok {top_k} in {path} is not between 1 and the {experts} experts"
        )
    layers = range(config["num_hidden_layers"])
    if arch == "MixtralForCausalLM":  # every layer sparse, top-k always renormalized
        return MoeConfig(experts, top_k, config["intermediate_size"], True, 0, tuple(layers))
    step = int(c.get("decoder_sparse_step", 1))
    dense = set(c.get("mlp_only_layers") or ())
    if step < 1:
        raise ModelLoadError(f"decoder_sparse_step {step} in {path} must be at least 1")
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(c["moe_intermediate_size"]),
        norm_topk_prob=bool(c["norm_topk_prob"]),
        shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size", 0)),
        # transformers' rule (Qwen2MoeDecoderLayer): sparse unless listed dense, every step-th
        sparse_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
    )
