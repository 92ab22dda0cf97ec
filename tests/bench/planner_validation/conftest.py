"""A Llama-3.1-8B-shaped config-only model (small tokenizer) for the validation's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sim.conftest import LLAMA_8B_SHAPE, write_config_only_model


@pytest.fixture(scope="session")
def validation_model_dir(tmp_path_factory) -> Path:
    return write_config_only_model(tmp_path_factory.mktemp("validation-8b"), LLAMA_8B_SHAPE)
