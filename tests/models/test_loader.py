"""Loading Hugging Face model directories, and the errors for what is missing or unsupported."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import EngineConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.models.builtin import make_model
from pdserve.models.loader import ModelLoadError, load_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture
def tiny_copy(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "copy")


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="missing config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_lists_supported(tiny_copy):
    edit_config(tiny_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(tiny_copy)


def test_unsupported_rope_type(tiny_copy):
    edit_config(tiny_copy, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="rope_type 'yarn'"):
        load_model(tiny_copy)


def test_missing_weights_file_and_tensor(tiny_copy):
    weights = load_file(tiny_copy / "model.safetensors")
    (tiny_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(tiny_copy)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tiny_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        load_model(tiny_copy)


def test_missing_tokenizer(tiny_copy):
    (tiny_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        LLMEngine(EngineConfig(model=str(tiny_copy), num_kv_blocks=16))


def test_sharded_checkpoint_loads_the_same_model(tiny_dir, tiny_copy):
    weights = load_file(tiny_copy / "model.safetensors")
    (tiny_copy / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, tiny_copy / shard)
        weight_map.update(dict.fromkeys(shard_names, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    single, _ = load_model(tiny_dir)
    sharded, _ = load_model(tiny_copy)
    for (name, a), (_, b) in zip(
        single.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_bfloat16_engine_runs(tiny_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), dtype="bfloat16", num_kv_blocks=32))
    assert engine.kv_cache.dtype == torch.bfloat16
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4
