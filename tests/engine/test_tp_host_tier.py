"""The host KV tier (--kv-offload-gb) on a tensor-parallel worker: rank 0's tier decides, and
every rank copies its own heads' slice of each block to and from its own host pool
(pdserve/engine/tp_executor.py). Spawned Gloo ranks serve test_host_tier_generation's
multi-turn chat, whose prefixes overflow the device pool, with the tier forced to hit: the
greedy tokens equal a TP-1 engine's without a tier, and so do their log-probabilities (to
float32 all-reduce rounding). The tokens alone are not enough: this random model's greedy
tokens survived a follower rank serving unit-scale noise for its restored blocks; their
log-probabilities did not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.bench.common.spawned_ranks import run_on_ranks
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import TorchExecutor
from pdserve.engine.tp_executor import LeaderExecutor, follow
from pdserve.engine_config import EngineConfig
from pdserve.models.tensor_parallel import TensorParallel
from tests.engine.conftest import random_prompts
from tests.engine.test_host_tier_generation import CONVERSATIONS, DEVICE_BLOCKS, MAX_TOKENS, TURNS
from tests.models.test_llama_matches_transformers import VOCAB, make_hf_model

pytest.importorskip("transformers")

HOST_BLOCKS = 200  # the whole chat: every evicted prefix comes back from host memory
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)


def chat(engine: LLMEngine) -> list[tuple[list[int], list[int], list[float]]]:
    """test_host_tier_generation's chat in this model's vocabulary: (prompt, output tokens,
    their log-probabilities) of each turn."""
    history = random_prompts([40] * CONVERSATIONS, seed=3, vocab=VOCAB)
    messages = random_prompts([9] * (CONVERSATIONS * TURNS), seed=4, vocab=VOCAB)
    transcript = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            prompt = history[c] + messages[turn * CONVERSATIONS + c]
            engine.add_request(f"t{turn}c{c}", prompt, GREEDY)
            tokens, logprobs = [], []
            while engine.has_unfinished():
                for out in engine.step():
                    tokens += out.new_token_ids
                    logprobs += out.new_logprobs
            transcript.append((prompt, tokens, logprobs))
            history[c] = prompt + tokens
    return transcript


def config(model_dir: str, tp: int, offload_gb: float = 0.0) -> EngineConfig:
    return EngineConfig(
        model=model_dir, block_size=4, num_kv_blocks=DEVICE_BLOCKS, tp=tp, kv_offload_gb=offload_gb
    )


def rank_work(rank: int, size: int, model_dir: str, offload_gb: float, out: str) -> None:
    """One rank's part, in spawned_ranks.run_on_ranks' Gloo group."""
    tp = TensorParallel(rank, size)
    rank_config = config(model_dir, size, offload_gb)
    executor = TorchExecutor(rank_config, Path(model_dir), tp)
    if rank:
        follow(executor, tp)
    else:
        leader = LeaderExecutor(executor, tp)
        engine = LLMEngine(rank_config, executor=leader)
        transcript = chat(engine)
        leader.stop()
        torch.save((transcript, engine.stats()), Path(out))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-gqa")
    make_hf_model(directory, "qwen2", num_key_value_heads=2)
    return str(directory)


@pytest.mark.parametrize("size", [2, 4], ids=["tp2", "tp4-replicated-heads"])
def test_a_tp_worker_with_a_host_tier_generates_as_tp1_without(model_dir, size, tmp_path):
    reference = LLMEngine(config(model_dir, 1))
    expected = chat(reference)
    offload_gb = HOST_BLOCKS * reference.bytes_per_block / 2**30
    out = tmp_path / "out.pt"
    run_on_ranks(size, rank_work, (model_dir, offload_gb, str(out)), timeout_s=300)
    transcript, stats = torch.load(out)
    assert [t[:2] for t in transcript] == [t[:2] for t in expected]
    got = torch.tensor([lp for t in transcript for lp in t[2]])
    assert torch.allclose(got, torch.tensor([lp for t in expected for lp in t[2]]), atol=1e-4)
    # The tier was hit: prefixes came back from every rank's host pool, not recomputed.
    assert stats["num_host_blocks"] == HOST_BLOCKS
    assert stats["host_restored_blocks"] * 4 == stats["prefix_host_hit_tokens"] > 0
    assert stats["prefill_tokens_computed"] < reference.stats()["prefill_tokens_computed"]
