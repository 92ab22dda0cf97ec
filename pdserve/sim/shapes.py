"""config.json of published model shapes, for config-only model directories (`pdserve
make-model DIR --config-only --preset llama-3.1-8b`): what a sim worker needs of a model.

Sizes are those of the published config.json files (Meta's Llama 3.1; Qwen's Qwen3-30B-A3B and
Qwen3-235B-A22B; Mistral's Mixtral-8x7B-v0.1); the special token ids are those of pdserve's
built-in tokenizer (BOS 0, EOS 1, PAD 2), which the directory is written with.
"""

from __future__ import annotations

from typing import Any

_LLAMA_3_1: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "bfloat16",
}

_TOKENS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "bfloat16"}
_QWEN3_MOE: dict[str, Any] = {
    **_TOKENS,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **_LLAMA_3_1,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "llama-3.1-70b": {
        **_LLAMA_3_1,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    # A 32B-class dense model: Qwen2.5-32B's sizes on the Llama layout (the analytical model
    # counts no biases, so Qwen2's q/k/v biases change nothing it prices).
    "qwen2.5-32b": {
        **_LLAMA_3_1,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
    },
    "qwen3-30b-a3b": {
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
    },
    "qwen3-235b-a22b": {
        **_QWEN3_MOE,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
    },
    "mixtral-8x7b": {
        **_TOKENS,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,  # of each expert
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
}


def shape_config(name: str) -> dict[str, Any]:
    """A fresh copy of the named shape's config.json content; KeyError if unknown."""
    return dict(SHAPES[name])
