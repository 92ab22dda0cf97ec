"""The sizes of a decoder-only transformer that its step time depends on, from config.json.

Counts follow the Llama family (pdserve's model code): per layer q/k/v/o projections and a
gated MLP (gate, up, down); norms and rotary embeddings are negligible and left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    dtype_bytes: int

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype: str) -> ModelShape:
        """Raises ValueError naming a missing config.json key or an unknown dtype."""
        missing = [key for key in REQUIRED_KEYS if key not in config]
        if missing:
            raise ValueError(f"config.json: missing {', '.join(missing)}")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype_bytes=DTYPE_BYTES[dtype],
        )

    @property
    def layer_params(self) -> int:
        """Weights of the matrix multiplies of one layer (attention projections and MLP)."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate

    @property
    def body_params(self) -> int:
        """Weights every token multiplies through (all layers; not the embedding or LM head)."""
        return self.layers * self.layer_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """Every weight once, as a step streams them from memory (embedding table included)."""
        embeddings = self.lm_head_params * (1 if self.tied_embeddings else 2)
        return (self.body_params + embeddings) * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query token, key token) pair over all layers: Q·K and P·V."""
        return 4 * self.heads * self.head_dim * self.layers

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def gpu_kv_blocks(
    model_config: dict[str, Any], gpu: str, tp: int, dtype: str, block_size: int
) -> int:
    """KV blocks of one worker: the memory of its `tp` GPUs (pdserve/sim/gpus.py) less one copy
    of the weights, in blocks of `block_size` tokens. ValueError when the weights do not fit."""
    from pdserve.sim.gpus import gpu_spec

    shape = ModelShape.from_config(model_config, dtype)
    free = gpu_spec(gpu).memory_bytes * tp - shape.weight_bytes
    if free <= 0:
        raise ValueError(
            f"--gpu {gpu} --tp {tp}: the weights ({shape.weight_bytes / 1e9:.0f} GB) do not fit"
        )
    return free // (shape.kv_bytes_per_token * block_size)
