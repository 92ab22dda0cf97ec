"""Loads a Hugging Face model directory (config.json + safetensors) into LlamaForCausalLM.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and the
mixtures of experts Qwen2MoeForCausalLM, Qwen3MoeForCausalLM and MixtralForCausalLM; which
config.json fields are honoured is listed in hf_config.py. Experts are read in either layout a
checkpoint has: one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`: what the published checkpoints and transformers'
save_pretrained write) or transformers 5's stacked `mlp.experts.gate_up_proj`; both become
moe.Experts' stacked tensors (transposed: input dimension first). Anything else (a field we cannot compute, a missing
tensor, a checkpoint tensor the model would not use) fails with a ModelLoadError that names the
directory and what is missing or unsupported; nothing is ever downloaded.

A tensor-parallel rank reads only its slices of the checkpoint (tp_layout.py), through
safetensors' lazy slices: each rank holds 1/N of every layer's weights, never the whole model.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.models.hf_config import ModelLoadError, llama_config, read_config
from pdserve.models.llama import LlamaConfig, LlamaForCausalLM, shard_layout
from pdserve.models.moe import reset_routed_tokens
from pdserve.models.tensor_parallel import TensorParallel
from pdserve.models.tp_layout import ShardLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint names (per layer) fused into one of our parameters, in concatenation order.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.gate_up_proj.bias": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_expert.gate_up_proj.weight": (
        "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj",
    ),
}
# Stacked expert parameters (moe.Experts) -> each expert's checkpoint tensors, concatenated, in
# the Qwen-MoE and the Mixtral naming.
_PER_EXPERT = {
    "mlp.experts.gate_up_proj": (
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
    ),
    "mlp.experts.down_proj": (
        ("mlp.experts.{e}.down_proj.weight",),
        ("block_sparse_moe.experts.{e}.w2.weight",),
    ),
}
_EXPERT_WEIGHTS = tuple(_PER_EXPERT)
_MIXTRAL_ROUTER = "block_sparse_moe.gate.weight"  # our mlp.gate.weight
# Checkpoint tensors recomputed from config.json rather than loaded (older Llama checkpoints).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)
_RANK_0_ONLY = ("self_attn.o_proj.bias", "mlp.down_proj.bias")
_SHARED = ".mlp.shared_expert"  # also matches shared_expert_gate
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


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
    # torch.empty, not Module.to_empty: empty_like of a meta tensor runs torch's Python
    # reference, whose first use imports sympy (0.3 s of every worker's start). Made in the
    # target dtype at once (floating tensors, as Module.to casts them): not in float32 first and
    # then copied, which held the weights twice, at twice the size under bfloat16.
    target = DTYPES[dtype]
    model._apply(
        lambda t: torch.empty(
            t.shape, dtype=target if t.is_floating_point() else t.dtype, device=device
        )
    )
    model.load_state_dict(state, strict=False, assign=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope(device)
    reset_routed_tokens(model)
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
        # Row-parallel biases and the shared expert (but for expert parallelism) live on rank 0
        # (tensor_parallel.py, tp_layout.py); rank 0 checks them.
        shared_here = model.tp.expert_parallel
        unused = {
            n for n in unused if not n.endswith(_RANK_0_ONLY) and (shared_here or _SHARED not in n)
        }
    if model.tp is not None:  # other ranks' experts: they check them
        first, end = checkpoint.layout.experts
        unused = {n for n in unused if not _expert_outside(n, first, end)}
    present = checkpoint.names()
    for name, param in model.named_parameters():
        if config.tie_word_embeddings and name == "lm_head.weight":
            unused.discard(name)  # transformers ties it to the embedding too
            continue
        groups, stacked = _checkpoint_parts(name, present, config, checkpoint.layout)
        parts = [p for group in groups for p in group]
        unused.difference_update(parts)
        found = {p: checkpoint.get(p) for p in parts}
        if any(t is None for t in found.values()):
            missing += [p for p, t in found.items() if t is None]
            continue
        joined = [torch.cat([found[p] for p in group], dim=0) for group in groups]
        tensor = torch.stack(joined) if stacked else joined[0]
        if name.endswith(_EXPERT_WEIGHTS):  # moe.Experts holds them input dimension first
            tensor = tensor.transpose(1, 2).contiguous()
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


def _expert_outside(name: str, first: int, end: int) -> bool:
    """Whether checkpoint tensor `name` is one expert's, of an expert not in [first, end)."""
    match = _EXPERT_INDEX.search(name)
    return match is not None and not first <= int(match[1]) < end


def _checkpoint_parts(
    name: str, present: set[str], config: LlamaConfig, layout: ShardLayout | None
) -> tuple[list[list[str]], bool]:
    """Checkpoint tensor names (without the `model.` prefix) that make up our parameter: each
    inner list concatenated along rows, and whether the lists (one per expert: the rank's
    experts under `layout`) are stacked along a new first dimension. `present`: the
    checkpoint's names, which decide between the layouts of expert weights."""
    if not name.startswith("layers."):
        return [[name]], False
    index, local = name.split(".", 2)[1:]
    prefix = f"layers.{index}."
    if local in _FUSED:
        suffix = local.rsplit(".", 1)[1]
        return [[f"{prefix}{part}.{suffix}" for part in _FUSED[local]]], False
    if local == "mlp.gate.weight" and prefix + _MIXTRAL_ROUTER in present:
        return [[prefix + _MIXTRAL_ROUTER]], False
    if local in _PER_EXPERT and name not in present:
        assert config.moe is not None
        first, end = layout.experts if layout is not None else (0, config.moe.num_experts)
        naming = next(
            (n for n in _PER_EXPERT[local] if prefix + n[0].format(e=first) in present),
            _PER_EXPERT[local][0],  # neither: reported missing under the Qwen names
        )
        experts = range(first, end)
        return [[prefix + part.format(e=e) for part in naming] for e in experts], True
    return [[name]], False
