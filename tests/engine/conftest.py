from __future__ import annotations

import pytest
import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import make_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny-model"), "tiny", seed=0)


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture
def make_engine(tiny_dir):
    """make_engine(**EngineConfig fields) -> LLMEngine on the tiny model (block size 4)."""

    def make(sink=None, **overrides) -> LLMEngine:
        settings = dict(model=str(tiny_dir), block_size=4, num_kv_blocks=128)
        settings.update(overrides)
        return LLMEngine(EngineConfig(**settings), kv_event_sink=sink)

    return make


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
