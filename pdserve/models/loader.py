"""Loads a Hugging Face model directory (config.json + safetensors) into LlamaForCausalLM.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM; which config.json fields
are honoured is listed in hf_config.py. Anything else (a field we cannot compute, a missing
tensor, a checkpoint tensor the model would not use) fails with a ModelLoadError that names the
directory and what is missing or unsupported; nothing is ever downloaded.

A tensor-parallel rank reads only its slices of the checkpoint (tp_layout.py), through
safetensors' lazy slices: each rank holds 1/N of every layer's weights, never the whole model.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.models.hf_config import ModelLoadError, llama_config, read_config
from pdserve.models.llama import LlamaForCausalLM, shard_layout
from pdserve.models.tensor_parallel import TensorParallel
from pdserve.models.tp_layout import ShardLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint names (per layer) fused into one of our parameters, in concatenation order.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.gate_up_proj.bias": ("mlp.gate_proj", "mlp.up_proj"),
}
# Checkpoint tensors recomputed from config.json rather than loaded (older Llama checkpoints).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)
_RANK_0_ONLY = ("self_attn.o_proj.bias", "mlp.down_proj.bias")


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


class _Checkpoint:
    """The checkpoint's tensors by name (without the `model.` prefix), read on demand: whole,
    or only a rank's slice (`layout`; None = whole tensors)."""

    def __init__(self, files: list[Path], stack: ExitStack, layout: ShardLayout | None):
        self.layout = layout
        self._where: dict[str, tuple[Any, str]] = {}
        for path in files:
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                self._where[name.removeprefix("model.")] = (f, name)

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor | None:
        if name not in self._where:
            return None
        f, stored = self._where[name]
        cut = self.layout.slice_of(name) if self.layout is not None else None
        if cut is None:
            return f.get_tensor(stored)
        dim, start, end = cut
        lazy = f.get_slice(stored)
        tensor = lazy[start:end] if dim == 0 else lazy[:, start:end]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            # The last vocabulary shard padded to vocab_per_rank rows (never looked up, and
            # its logits are cut off after the gather).
            tensor = F.pad(tensor, (0, 0, 0, self.layout.vocab_per_rank - tensor.shape[0]))
        return tensor


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    tp: TensorParallel | None = None,
) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """The model with its weights, in eval mode, and its config.json dict. `tp`: this process
    is one rank of a tensor-parallel group and loads only its shard."""
    model_dir = Path(model_dir)
    hf_config = read_config(model_dir)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    config = llama_config(hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    layout = shard_layout(config, model.tp) if model.tp is not None else None
    with ExitStack() as stack:
        checkpoint = _Checkpoint(_weight_files(model_dir), stack, layout)
        state = _state_dict(model, checkpoint, model_dir, dtype)
    model.to_empty(device=device).to(DTYPES[dtype])
    model.load_state_dict(state, strict=False, assign=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope(device)
    return model.eval(), hf_config


def _state_dict(
    model: LlamaForCausalLM, checkpoint: _Checkpoint, model_dir: Path, dtype: str
) -> dict[str, torch.Tensor]:
    """Every parameter's tensor from the checkpoint (fused ones concatenated); ModelLoadError
    for a missing tensor, a shape that disagrees, or a checkpoint tensor with no place."""
    config = model.config
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    unused = {n for n in checkpoint.names() if not n.endswith(_DERIVED_SUFFIXES)}
    if model.tp is not None and model.tp.rank > 0:
        # Row-parallel biases live on rank 0 (tensor_parallel.RowParallelLinear); rank 0
        # checks them.
        unused = {n for n in unused if not n.endswith(_RANK_0_ONLY)}
    for name, param in model.named_parameters():
        if config.tie_word_embeddings and name == "lm_head.weight":
            unused.discard(name)  # transformers ties it to the embedding too
            continue
        parts = _checkpoint_parts(name)
        unused.difference_update(parts)
        found = [checkpoint.get(p) for p in parts]
        if any(t is None for t in found):
            missing += [p for p, t in zip(parts, found, strict=True) if t is None]
            continue
        tensor = torch.cat(found, dim=0) if len(found) > 1 else found[0]
        if tensor.shape != param.shape:
            raise ModelLoadError(
                f"{name} in {model_dir} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(param.shape)}"
                + ("" if model.tp is None else f" (rank {model.tp.rank} of {model.tp.size})")
            )
        state[name] = tensor.to(DTYPES[dtype])
    if missing:
        raise ModelLoadError(f"weights missing from {model_dir}: {_first_few(missing)}")
    if unused:
        raise ModelLoadError(
            f"tensors in {model_dir} that config.json gives no place to (a bias or layer it "
            f"does not declare?): {_first_few(sorted(unused))}"
        )
    return state


def _first_few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


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
