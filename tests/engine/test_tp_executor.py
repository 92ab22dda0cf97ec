"""A tensor-parallel worker's rank 0 alone schedules and samples; the other ranks replay its
commands (pdserve/engine/tp_executor.py). Run as spawned Gloo ranks: rank 0's greedy, seeded
(n = 2), beam, DoLa, SLED and ngram-speculative outputs equal a TP-1 engine's; KV written
through rank 0 (every head) reads back byte for byte, and each other rank's own cache holds
exactly its KV heads' slice (at TP 4 with 2 KV heads: each head on two ranks)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from pdserve.engine.engine import LLMEngine
from pdserve.models.llama import shard_layout
from pdserve.models.tensor_parallel import TensorParallel
from tests.engine.tp_leader_ranks import engine_config, free_port, rank_main, run_requests
from tests.models.test_llama_matches_transformers import make_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-gqa")
    make_hf_model(directory, "qwen2", num_key_value_heads=2)
    return str(directory)


def run_ranks(size: int, model_dir: str, kv: torch.Tensor, out) -> tuple:
    context = mp.start_processes(
        rank_main,
        args=(size, free_port(), model_dir, kv, str(out)),
        nprocs=size,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + 300
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{size} ranks still running")
    return torch.load(out)


@pytest.mark.parametrize("size", [2, 4])  # 4: more ranks than KV heads (replicated)
def test_leader_and_followers_serve_as_one_engine(model_dir, size, tmp_path):
    reference = LLMEngine(engine_config(model_dir, 1))
    expected = run_requests(reference)
    assert expected["drafted"][0] > 0  # verify steps with draft rows ran
    layers = reference.num_layers
    kv = torch.randn(layers, 2, 3, 8, 2, reference.model.config.head_dim)
    generated, whole, top, bytes_per_block = run_ranks(size, model_dir, kv, tmp_path / "r.pt")
    assert generated == expected
    assert torch.equal(whole, kv)
    assert torch.equal(top, kv[1:, :, 1:])
    assert bytes_per_block == reference.bytes_per_block
    config = reference.model.config
    for rank in range(1, size):  # each rank holds its KV heads' slice, byte for byte
        layout = shard_layout(config, TensorParallel(rank, size))
        first, end = layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads
        held = torch.load(tmp_path / f"r.pt.rank{rank}")
        assert torch.equal(held, kv[..., first:end, :])
