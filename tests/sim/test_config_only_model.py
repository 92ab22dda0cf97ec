"""`pdserve make-model --config-only`: a weightless model directory a sim engine serves."""

from __future__ import annotations

import json

from pdserve.cli import main
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from tests.sim.conftest import sim_config


def test_a_config_only_llama_shape_serves_sim_engines(tmp_path, capsys):
    directory = tmp_path / "llama-8b"
    assert main(["make-model", str(directory), "--config-only", "--preset", "llama-3.1-8b"]) == 0
    assert "32 layers, hidden 4096, vocab 128256 (config only" in capsys.readouterr().out
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    assert json.loads((directory / "config.json").read_text())["num_key_value_heads"] == 8
    engine = LLMEngine(sim_config(directory))
    tokens = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4))[0]
    assert len(tokens) == 4 and all(2 < t < 128256 for t in tokens)
    assert engine.bytes_per_block == 4 * 2 * 32 * 8 * 128 * 2  # bfloat16 KV of 4 tokens


def test_a_shape_without_config_only_is_a_one_line_error(tmp_path, capsys):
    assert main(["make-model", str(tmp_path / "m"), "--preset", "llama-3.1-70b"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith(
        "--preset llama-3.1-70b has no weights: add --config-only, or --with-weights for random ones"
    )
    assert "\n" not in error and not (tmp_path / "m").exists()
