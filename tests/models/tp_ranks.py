"""Runs the engine as every rank of a tensor-parallel group, one spawned process per rank over
Gloo on 127.0.0.1 (what a TP worker's rank actors do, without Ray; spawned_ranks.py): each rank
serves the same requests on its shard; each writes what it sampled and its logits to a file."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.bench.common.spawned_ranks import run_on_ranks
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.tensor_parallel import TensorParallel


def serve(
    model_dir: str, prompts: list[list[int]], max_tokens: int, tp: TensorParallel | None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The engine's greedy outputs of `prompts` (one batch) and the logits of every step."""
    config = EngineConfig(
        model=model_dir,
        block_size=8,
        num_kv_blocks=64,
        tp=tp.size if tp else 1,
        expert_parallel=tp.expert_parallel if tp else False,
    )
    engine = LLMEngine(config, tensor_parallel=tp)
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def recording(batch):
        logits, idx = run(batch)
        seen.append(logits.clone())
        return logits, idx

    engine.runner.run = recording
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return outputs, seen


def _serve_rank(
    rank: int, size: int, jobs: list[tuple], out_dir: str, expert_parallel: bool
) -> None:
    tp = TensorParallel(rank, size, expert_parallel=expert_parallel)
    results = [serve(model_dir, prompts, n, tp) for model_dir, prompts, n in jobs]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def serve_on_ranks(
    size: int,
    jobs: list[tuple],
    out_dir: Path,
    timeout_s: float = 300,
    expert_parallel: bool = False,
) -> list[list[tuple]]:
    """Each rank's `serve` results of every (model_dir, prompts, max_tokens) job, by rank;
    `expert_parallel`: MoE layers dispatch with all_to_all (--expert-parallel)."""
    run_on_ranks(size, _serve_rank, (jobs, str(out_dir), expert_parallel), timeout_s)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(size)]
