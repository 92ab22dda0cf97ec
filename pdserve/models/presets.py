"""Sizes of the random-weight models `pdserve make-model` writes, as Hugging Face config.json.

tiny: the default model everywhere and the test model (the whole suite runs on it in seconds).
small: big enough that matmuls dominate a decode step, for `pdserve bench engine`.
medium: 233M parameters (0.93 GB in float32, ~30x this machine's L3 cache), so a CPU decode
step at a few rows is bound by reading the weights, as a GPU's is: the regime speculative
decoding is for (`pdserve bench spec --preset medium`; on `small` a verify of 5 positions costs
~1.9 plain steps of few-row matmuls, BENCHMARKS.md). Written on first use (~6 s).
small-moe: `small`'s attention with a Qwen3-MoE MLP in every layer (15 experts of 256 rows, top
4, renormalized: 4 x 256 = 1024 active rows per token against small's 1408), for `bench
engine --model` on a mixture of experts.
"""

from __future__ import annotations

from typing import Any

from pdserve.models.tokenizer_builder import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_COMMON,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
    },
    "small": {
        **_COMMON,
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 2048,
    },
    "medium": {
        **_COMMON,
        "vocab_size": 8192,
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 6,
        "head_dim": 128,
        "max_position_embeddings": 2048,
    },
    "small-moe": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1408,  # of dense layers (mlp_only_layers): none here
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "num_experts": 15,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}
WEIGHT_PRESETS = tuple(PRESETS)  # every preset here is written with weights


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of the named preset's config.json content."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dict(PRESETS[name])
