"""The sizes of a decoder-only transformer that its step time depends on, from config.json.

Counts follow the Llama family (pdserve's model code): per layer q/k/v/o projections and a
gated MLP (gate, up, down); norms and rotary embeddings are negligible and left out.

A mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral: `MoeShape`) replaces the MLP of its sparse
layers by a router, `experts` gated MLPs of which each token uses `experts_per_token`, and
Qwen2-MoE's gated shared expert. Its FLOPs per token count the active parameters (the experts a
token uses); its memory counts every parameter; a step reads the weights of the experts its
tokens touch (`step_weight_bytes`).
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


_MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoeShape:
    experts: int  # routed experts of each sparse layer
    experts_per_token: int
    expert_intermediate: int
    shared_intermediate: int  # Qwen2-MoE's shared expert; 0 = none
    sparse_layers: int  # layers whose MLP is the mixture (the others are dense)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoeShape | None:
        """None for a dense model. transformers' defaults and layer rule, as the engine's loader
        reads them (pdserve/models/hf_config.py)."""
        architectures = config.get("architectures") or []
        if not any(a in _MOE_ARCHITECTURES for a in architectures):
            return None
        layers = int(config["num_hidden_layers"])
        experts = int(config.get("num_local_experts") or config.get("num_experts") or 8)
        if "MixtralForCausalLM" in architectures:
            top_k = int(config.get("num_experts_per_tok", 2))
            return cls(experts, top_k, int(config["intermediate_size"]), 0, layers)
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            experts,
            int(config["num_experts_per_tok"]),
            int(config["moe_intermediate_size"]),
            int(config.get("shared_expert_intermediate_size") or 0),
            sparse,
        )

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts of one layer that `tokens` tokens choose, each choosing
        experts_per_token of the experts uniformly: E (1 - (1 - k/E)^B). 1 token: k; many:
        every expert. (Real routing is skewed, which touches fewer: an upper bound.)"""
        e, k = self.experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)


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
    moe: MoeShape | None = None

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
            moe=MoeShape.from_config(config),
        )

    @property
    def attention_params(self) -> int:
        """Weights of one layer's q/k/v/o projections."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v

    @property
    def layer_params(self) -> int:
        """Weights of the matrix multiplies of one dense layer (attention projections and MLP)."""
        return self.attention_params + 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert (gate, up, down); 0 for a dense model."""
        return 3 * self.hidden * self.moe.expert_intermediate if self.moe else 0

    @property
    def _dense_body_params(self) -> int:
        """Weights every token multiplies through except the routed experts: attention, dense
        MLPs, the routers and shared experts."""
        if self.moe is None:
            return self.layers * self.layer_params
        m, h = self.moe, self.hidden
        sparse_layer = h * m.experts + (
            3 * h * m.shared_intermediate + h if m.shared_intermediate else 0
        )
        dense_layers = self.layers - m.sparse_layers
        return (
            self.layers * self.attention_params
            + dense_layers * 3 * h * self.intermediate
            + m.sparse_layers * sparse_layer
        )

    @property
    def body_params(self) -> int:
        """Weights each token multiplies through (all layers; not the embedding or LM head): of a
        mixture of experts the active ones, experts_per_token experts per sparse layer."""
        if self.moe is None:
            return self._dense_body_params
        active = self.moe.sparse_layers * self.moe.experts_per_token * self.expert_params
        return self._dense_body_params + active

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert's weights (0 for a dense model)."""
        return self.moe.sparse_layers * self.moe.experts * self.expert_params if self.moe else 0

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """Every weight once (embedding table and every expert included): the memory they hold,
        and what a step of a dense model streams from it."""
        embeddings = self.lm_head_params * (1 if self.tied_embeddings else 2)
        total = self._dense_body_params + self.routed_expert_params + embeddings
        return total * self.dtype_bytes

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` new tokens reads: every weight of a dense model; of a
        mixture of experts, all but the routed experts plus the experts its tokens touch in each
        sparse layer (MoeShape.experts_touched)."""
        if self.moe is None:
            return self.weight_bytes
        untouched = self.moe.experts - self.moe.experts_touched(tokens)
        return (
            self.weight_bytes
            - self.moe.sparse_layers * untouched * self.expert_params * self.dtype_bytes
        )

    @property
    def routed_active_params(self) -> int:
        """Routed-expert weights one token multiplies through (0 for a dense model)."""
        return (
            self.moe.sparse_layers * self.moe.experts_per_token * self.expert_params
            if self.moe
            else 0
        )

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
