"""`make-model --dtype/--device/--with-weights`: random weights of a chosen type, drawn where
asked, loading in pdserve and in transformers; the default files stay what they were."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pdserve.cli import main
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import make_model


def test_bfloat16_weights_load_and_serve(tmp_path):
    out = tmp_path / "bf16"
    assert main(["make-model", str(out), "--dtype", "bfloat16", "--seed", "3"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    weights = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    # The same draws as the float32 model of the same seed, rounded.
    reference = load_file(str(make_model(tmp_path / "f32", "tiny", seed=3) / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(weights[name], reference[name].to(torch.bfloat16))
    engine = LLMEngine(EngineConfig(model=str(out), dtype="bfloat16", kv_cache_bytes=4 << 20))
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]) == 3
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert hf.dtype == torch.bfloat16


def test_a_device_that_is_not_there_is_a_one_line_error(tmp_path, capsys):
    code = main(["make-model", str(tmp_path / "m"), "--device", "nowhere"])
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert "--device nowhere" in error and "\n" not in error


def test_config_only_refuses_weight_options(tmp_path, capsys):
    code = main(["make-model", str(tmp_path / "m"), "--config-only", "--dtype", "bfloat16"])
    assert code == 2
    assert "--config-only writes no weights" in capsys.readouterr().err
