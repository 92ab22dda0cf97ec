"""Runs the engine as every rank of a tensor-parallel group, one spawned process per rank over
Gloo on 127.0.0.1 (what a TP worker's rank actors do, without Ray): each rank serves the same
requests on its shard; each writes what it sampled and its logits to a file."""

from __future__ import annotations

import socket
import time
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
    config = EngineConfig(model=model_dir, block_size=8, num_kv_blocks=64, tp=tp.size if tp else 1)
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


def _rank(rank: int, size: int, port: int, jobs: list[tuple], out_dir: str) -> None:
    torch.set_num_threads(1)  # N processes share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        tp = TensorParallel(rank, size)
        results = [serve(model_dir, prompts, n, tp) for model_dir, prompts, n in jobs]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def serve_on_ranks(
    size: int, jobs: list[tuple], out_dir: Path, timeout_s: float = 300
) -> list[list[tuple]]:
    """Each rank's `serve` results of every (model_dir, prompts, max_tokens) job, by rank.
    Ranks that disagree on a collective would wait forever: past `timeout_s` they are killed."""
    context = mp.start_processes(
        _rank,
        args=(size, free_port(), jobs, str(out_dir)),
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
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(size)]
