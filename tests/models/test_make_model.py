"""`pdserve make-model` and the built-in default model."""

from __future__ import annotations

import argparse
import json
import multiprocessing

import pytest

from pdserve.commands import make_model as make_model_command
from pdserve.models.builtin import default_model_dir, make_model
from pdserve.tokenizer import Tokenizer


def main(argv: list[str]) -> int:
    """`pdserve make-model ARGS` (this command's parser only, so other commands need not load)."""
    parser = argparse.ArgumentParser(prog="pdserve make-model")
    make_model_command.add_arguments(parser)
    return make_model_command.run(parser.parse_args(argv))


def test_make_model_cli_is_deterministic(tmp_path, capsys):
    assert main([str(tmp_path / "a")]) == 0
    assert "tiny" in capsys.readouterr().out
    assert main([str(tmp_path / "b"), "--preset", "tiny", "--seed", "0"]) == 0
    assert main([str(tmp_path / "c"), "--seed", "1"]) == 0
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(
        files
    )
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_tokenizer_vocab_and_special_ids_match_config(tmp_path):
    make_model(tmp_path, "tiny")
    config = json.loads((tmp_path / "config.json").read_text())
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.vocab_size == config["vocab_size"]
    assert tokenizer.eos_token_ids == [config["eos_token_id"]] == [generation["eos_token_id"]]
    assert tokenizer.bos_token_id == config["bos_token_id"]


def test_transformers_loads_make_model_output(tmp_path):
    transformers = pytest.importorskip("transformers")
    make_model(tmp_path, "tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.num_hidden_layers == 2


def _build(_):
    return str(default_model_dir())


def test_default_model_is_created_once_even_by_racing_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        dirs = pool.map(_build, range(2))
    assert dirs[0] == dirs[1]
    assert str(default_model_dir()) == dirs[0]
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir()] == [default_model_dir().name]  # no temp leftovers


@pytest.mark.parametrize("extra", [[], ["--config-only"]], ids=["weights", "config-only"])
def test_make_model_writes_a_tool_calling_chat_template(tmp_path, extra):
    from pdserve.models.tool_chat_templates import TEMPLATES

    assert main([str(tmp_path / "m"), "--chat-template", "mistral", *extra]) == 0
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TEMPLATES["mistral"]
    assert main([str(tmp_path / "p"), *extra]) == 0
    config = json.loads((tmp_path / "p" / "tokenizer_config.json").read_text())
    assert "[TOOL_CALLS]" not in config["chat_template"]
