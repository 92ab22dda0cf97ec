"""A tensor-parallel worker's rank 0 alone schedules and samples; the other ranks replay its
commands (pdserve/engine/tp_executor.py). Run as spawned Gloo ranks: rank 0's greedy, seeded
(n = 2), beam, DoLa, SLED outputs, speculative by ngram (TP 2 and 4; at 4 more ranks than KV
heads) and by a draft model (TP 2), equal a TP-1 engine's. Each rank's KV in a handoff:
tests/kv_transfer/test_tp_handoff.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.common.spawned_ranks import run_on_ranks
from pdserve.engine.engine import LLMEngine
from pdserve.models.draft_of import write_draft_of
from tests.engine.tp_leader_ranks import engine_config, rank_work, run_requests
from tests.models.test_llama_matches_transformers import make_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-gqa")
    make_hf_model(directory, "qwen2", num_key_value_heads=2)
    return str(directory)


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    """The model's first layer (of two), embedding, norm and LM head."""
    return str(write_draft_of(model_dir, tmp_path_factory.mktemp("draft"), 1)[0])


def run_ranks(size: int, model_dir: str, draft_dir: str | None, out) -> tuple:
    run_on_ranks(size, rank_work, (model_dir, draft_dir, str(out)), timeout_s=300)
    return torch.load(out)


@pytest.mark.parametrize(
    ("size", "draft"),
    [(2, False), (4, False), (2, True)],  # 4: more ranks than KV heads (replicated)
    ids=["tp2-ngram", "tp4-ngram", "tp2-draft-model"],
)
def test_leader_and_followers_serve_as_one_engine(model_dir, draft_dir, size, draft, tmp_path):
    draft_model = draft_dir if draft else None
    reference = LLMEngine(engine_config(model_dir, 1, draft_model))
    expected = run_requests(reference)
    assert expected["drafted"][0] > 0  # verify steps with draft rows ran
    generated, bytes_per_block = run_ranks(size, model_dir, draft_model, tmp_path / "r.pt")
    assert generated == expected
    assert bytes_per_block == reference.bytes_per_block  # every head's: what a handoff moves
