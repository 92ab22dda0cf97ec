"""Loading Hugging Face model directories, and the errors for what is missing or unsupported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import make_model
from pdserve.models.loader import ModelLoadError, load_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture
def tiny_copy(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "copy")


DROP = object()  # an edit_config value that removes the key


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not DROP}))


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
    edit_config(tiny_copy, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="rope_type 'longrope'"):
        load_model(tiny_copy)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(hidden_act="gelu_fast"), "hidden_act 'gelu_fast'"),
        (dict(hidden_act="tanh"), "hidden_act 'tanh'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
        (
            dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}),
            "partial_rotary_factor 0.25",
        ),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "default"}}),
            r"rope_parameters per layer type \['full_attention'\]",
        ),
        (dict(rope_scaling={"rope_type": "linear"}), "needs rope_parameters factor"),
        (
            dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
            "needs rope_parameters high_freq_factor",
        ),
        (dict(architectures=["MistralForCausalLM"]), "must set sliding_window for Mistral"),
        # Qwen3's head_dim default (128) is not hidden_size / heads as for Llama.
        (
            dict(architectures=["Qwen3ForCausalLM"], head_dim=DROP),
            "must set head_dim for Qwen3",
        ),
        (dict(max_position_embeddings=DROP), "lacks max_position_embeddings"),
        (
            dict(num_key_value_heads=3),
            "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
        ),
        (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config"),
    ],
)
def test_config_fields_that_change_the_math_are_refused_by_name(tiny_copy, changes, named):
    edit_config(tiny_copy, **changes)
    with pytest.raises(ModelLoadError, match=named):
        load_model(tiny_copy)


def test_qwen3_checkpoint_without_its_qk_norms_is_refused(tiny_copy):
    """A Llama checkpoint relabelled Qwen3 lacks the per-head q/k norms Qwen3 computes."""
    edit_config(tiny_copy, architectures=["Qwen3ForCausalLM"], head_dim=16)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.q_norm\.weight"):
        load_model(tiny_copy)


def test_checkpoint_tensor_the_config_does_not_declare_is_refused(tiny_copy):
    """An o_proj bias with attention_bias false would otherwise be dropped without a word."""
    weights = load_file(tiny_copy / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(weights, tiny_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.o_proj\.bias"):
        load_model(tiny_copy)


def test_declared_bias_missing_from_checkpoint_is_named(tiny_copy):
    edit_config(tiny_copy, mlp_bias=True)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.mlp\.gate_proj\.bias"):
        load_model(tiny_copy)


def test_stored_rotary_inv_freq_is_recomputed_not_refused(tiny_dir, tiny_copy):
    weights = load_file(tiny_copy / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, tiny_copy / "model.safetensors")
    loaded, _ = load_model(tiny_copy)
    reference, _ = load_model(tiny_dir)
    assert torch.equal(loaded.rope_cos, reference.rope_cos)


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


def test_loading_imports_neither_dynamo_nor_sympy(tiny_dir):
    """A worker's start-up: building on the meta device and materializing the model must not
    run torch's Python references, whose first use imports torch._dynamo and sympy (about
    1.3 s of every worker's start; pdserve/models/meta_init.py)."""
    code = (
        "import sys; from pdserve.models.loader import load_model; "
        f"load_model({str(tiny_dir)!r}); "
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
