"""A self-speculative draft of a model (LayerSkip-style): its embedding, its first N decoder
layers, its final norm and its LM head, written as a Hugging Face directory.

The draft shares the target's tokenizer (files copied) and vocabulary, so its proposals are the
target's own early-exit predictions: `pdserve serve --speculative draft --draft-model DIR`
verifies them with the full model. Tensors are copied unchanged, so layer i of the draft equals
layer i of the target.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.models.hf_config import ModelLoadError, read_config
from pdserve.models.loader import _weight_files

# Checkpoint files that hold weights (not copied: the draft gets its own model.safetensors).
_WEIGHT_FILE = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.pt|\.pth)$")
# The decoder layer a checkpoint tensor belongs to ("model.layers.3.mlp..." -> 3).
_LAYER_OF = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def default_draft_layers(num_layers: int) -> int:
    """A quarter of the target's layers, at least one."""
    return max(1, num_layers // 4)


def write_draft_of(
    target_dir: str | Path, out_dir: str | Path, num_layers: int | None = None
) -> tuple[Path, int]:
    """Writes the draft of `target_dir` into `out_dir`; returns (out_dir, its layer count).
    Raises ModelLoadError for a target that is not a supported model, or a layer count outside
    [1, the target's layers]."""
    target, out = Path(target_dir), Path(out_dir)
    config = read_config(target)
    total = int(config["num_hidden_layers"])
    layers = default_draft_layers(total) if num_layers is None else num_layers
    if not 1 <= layers <= total:
        raise ModelLoadError(f"draft layers must be in [1, {total}] (the target's), got {layers}")
    if out.resolve() == target.resolve():
        raise ModelLoadError(f"the draft cannot overwrite its target {target}")
    tensors = {}
    for path in _weight_files(target):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                layer = _LAYER_OF.search(name)
                if layer is None or int(layer.group(1)) < layers:
                    tensors[name] = f.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    for path in target.iterdir():
        if path.is_file() and path.name != "config.json" and not _WEIGHT_FILE.search(path.name):
            shutil.copy2(path, out / path.name)
    draft_config = dict(config, num_hidden_layers=layers)
    if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Qwen2, ...)
        draft_config["layer_types"] = config["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(draft_config, indent=2) + "\n", encoding="utf-8")
    return out, layers
