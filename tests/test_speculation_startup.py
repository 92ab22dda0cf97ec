"""`pdserve serve --speculative`: which pools speculate, and the settings refused at start-up
(one line, before Ray or any worker starts)."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.commands.serve import speculation_note
from pdserve.config import ServeConfig
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.startup_checks import StartupError, check_speculation
from pdserve.worker.pools import engine_for_role
from tests.test_cli import FAST_S, run_pdserve


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pdserve.models.builtin import make_model

    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def serve_config(method: str, draft_model: str | None = None, **serve) -> ServeConfig:
    spec = SpeculativeConfig(method=method, draft_model=draft_model)
    return ServeConfig(engine=EngineConfig(speculative=spec), **serve)


def test_only_the_decode_pool_speculates():
    config = serve_config("ngram")
    assert engine_for_role(config, "decode").speculative.method == "ngram"
    assert not engine_for_role(config, "prefill").speculative.enabled
    assert config.engine.speculative.method == "ngram"  # the shared config is left as it was
    plain = serve_config("")
    assert engine_for_role(plain, "prefill") is plain.engine


def test_a_missing_draft_model_is_one_line_before_ray_starts(model_dir, tmp_path):
    absent = tmp_path / "absent"
    code, lines, seconds = run_pdserve(
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--http-port",
        "0",
        "--speculative",
        "draft",
        "--draft-model",
        str(absent),
    )
    assert (code, lines) == (
        1,
        [f"pdserve serve: error: --draft-model: directory {absent} does not exist"],
    )
    assert seconds < FAST_S


def test_a_draft_with_another_vocabulary_is_refused(model_dir, tmp_path):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    draft = tmp_path / "draft"
    shutil.copytree(model_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    check_speculation(serve_config("draft", str(draft)), vocab)  # same vocabulary: accepted
    config["vocab_size"] = vocab + 8
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError) as refused:
        check_speculation(serve_config("draft", str(draft)), vocab)
    assert str(refused.value) == (
        f"--draft-model {draft}: vocab_size {vocab + 8} differs from the served model's {vocab} "
        "(a draft must share the target's tokenizer)"
    )
    (draft / "config.json").unlink()
    with pytest.raises(StartupError, match=r"^--draft-model .*/draft: .*config\.json"):
        check_speculation(serve_config("draft", str(draft)), vocab)


def test_simulated_decode_workers_do_not_speculate():
    with pytest.raises(StartupError, match="^--speculative ngram: simulated decode workers"):
        check_speculation(serve_config("ngram", decode_engine="sim"), 512)
    check_speculation(serve_config("ngram", prefill_engine="sim"), 512)  # prefill never does
    check_speculation(serve_config("", decode_engine="sim"), 512)


def test_serve_says_which_workers_speculate():
    assert speculation_note(serve_config("")) == ""
    assert speculation_note(serve_config("ngram")) == ", decode workers speculate: ngram, k=4"
