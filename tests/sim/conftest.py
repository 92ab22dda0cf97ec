"""A config-only model directory (config.json + tokenizer, no weights) and sim engines on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SimConfig
from pdserve.models.tokenizer_builder import write_tokenizer

VOCAB = 1024  # a small tokenizer keeps the fixture fast; the shape is Llama-3.1-8B's otherwise
LLAMA_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "vocab_size": VOCAB,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def write_config_only_model(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    write_tokenizer(directory, config["vocab_size"])
    return directory


@pytest.fixture(scope="session")
def sim_model_dir(tmp_path_factory) -> Path:
    return write_config_only_model(tmp_path_factory.mktemp("llama-8b-shape"), LLAMA_8B_SHAPE)


def sim_config(model_dir: Path, time_scale: float = 0.01, **overrides) -> EngineConfig:
    settings = dict(
        model=str(model_dir),
        kind="sim",
        dtype="bfloat16",
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=256,
        sim=SimConfig(time_scale=time_scale),
    )
    settings.update(overrides)
    return EngineConfig(**settings)


@pytest.fixture
def make_sim_engine(sim_model_dir):
    """make_sim_engine(sink=None, **EngineConfig fields) -> a sim LLMEngine (block size 4)."""

    def make(sink=None, **overrides) -> LLMEngine:
        return LLMEngine(sim_config(sim_model_dir, **overrides), kv_event_sink=sink)

    return make
