"""Runs the engine as every rank of a tensor-parallel group, one spawned process per rank over
Gloo on 127.0.0.1 (what a TP worker's rank actors do, without Ray): each rank serves the same
requests on its shard; each writes what it sampled and its logits to a file."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.tensor_parallel import TensorParallel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _in_group(rank: int, size: int, port: int, work: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # N processes share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        work(rank, size, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(size: int, work: Callable, args: tuple, timeout_s: float = 300) -> None:
    """work(rank, size, *args) in one spawned process per rank, all in one Gloo group (`work`
    importable by module path); raises when a rank raised. Ranks that disagree on a collective
    would wait forever: past `timeout_s` they are killed."""
    context = mp.start_processes(
        _in_group,
        args=(size, free_port(), work, args),
        nprocs=size,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{size} tensor-parallel ranks still running after {timeout_s} s")


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
