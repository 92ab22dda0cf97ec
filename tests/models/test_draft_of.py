"""`pdserve make-model --draft-of`: a self-speculative draft that transformers and pdserve load,
whose layers are the target's first layers."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pdserve.commands import CommandError
from pdserve.commands import make_model as make_model_command
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import make_model
from pdserve.models.draft_of import default_draft_layers
from pdserve.models.loader import load_model
from tests.models.hf_reference import hf_greedy


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdserve make-model")
    make_model_command.add_arguments(parser)
    return make_model_command.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "tiny", seed=3)


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    assert main([str(out), "--draft-of", str(target_dir)]) == 0
    return out


def test_default_is_a_quarter_of_the_layers_at_least_one():
    assert [default_draft_layers(n) for n in (1, 2, 4, 8, 10, 32)] == [1, 1, 1, 2, 2, 8]


def test_draft_config_and_tokenizer_are_the_targets_but_the_layer_count(target_dir, draft_dir):
    target = json.loads((target_dir / "config.json").read_text())
    draft = json.loads((draft_dir / "config.json").read_text())
    assert draft == dict(target, num_hidden_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (draft_dir / name).read_bytes() == (target_dir / name).read_bytes(), name


def test_draft_layers_equal_the_targets_first_layers_in_pdserve(target_dir, draft_dir):
    target, _ = load_model(target_dir)
    draft, _ = load_model(draft_dir)
    assert len(draft.layers) == 1
    target_params = dict(target.named_parameters())
    for name, param in draft.named_parameters():
        assert torch.equal(param, target_params[name]), name


def test_transformers_loads_the_draft_and_agrees_with_pdserve(draft_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 1
    prompts = [[5, 17, 300, 42, 9], list(range(3, 40))]
    engine = LLMEngine(EngineConfig(model=str(draft_dir), block_size=4, num_kv_blocks=64))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, params) == hf_greedy(hf, prompts, 12)


def test_all_layers_make_a_copy_that_generates_like_the_target(target_dir, tmp_path):
    assert main([str(tmp_path), "--draft-of", str(target_dir), "--draft-layers", "2"]) == 0
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[7, 8, 9, 10, 11, 12]]
    outputs = [
        LLMEngine(EngineConfig(model=str(d), block_size=4, num_kv_blocks=32)).generate(
            prompts, params
        )
        for d in (target_dir, tmp_path)
    ]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft-layers", "3"], r"draft layers must be in \[1, 2\]"),
        (["--preset", "small"], "drop --preset"),
        (["--seed", "1"], "drop --preset, --seed"),
        (["--config-only"], "--config-only"),
    ],
)
def test_bad_draft_requests_are_one_line_errors(target_dir, tmp_path, extra, message):
    with pytest.raises(CommandError, match=message):
        main([str(tmp_path / "d"), "--draft-of", str(target_dir), *extra])
    assert not (tmp_path / "d").exists()


def test_draft_of_a_missing_model_or_itself(target_dir, tmp_path):
    with pytest.raises(CommandError, match="does not exist"):
        main([str(tmp_path / "d"), "--draft-of", str(tmp_path / "nowhere")])
    with pytest.raises(CommandError, match="cannot overwrite its target"):
        main([str(target_dir), "--draft-of", str(target_dir)])
    with pytest.raises(CommandError, match="--draft-layers needs --draft-of"):
        main([str(tmp_path / "d"), "--draft-layers", "1"])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "d"), "--draft-of", str(target_dir), "--draft-layers", "0"])
