"""Rank processes of one tensor-parallel worker as the server runs it, without Ray: rank 0 runs
the engine on a LeaderExecutor, the other ranks `follow` it (pdserve/engine/tp_executor.py).
Rank 0 writes what it generated and the KV it read back to a file, each other rank the KV its
own cache holds."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import TorchExecutor
from pdserve.engine.tp_executor import LeaderExecutor, follow
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.tensor_parallel import TensorParallel
from tests.models.tp_ranks import free_port  # noqa: F401  (re-exported for the test)


def engine_config(model_dir: str, tp: int) -> EngineConfig:
    """Speculative (ngram, never paused): verify steps carry draft rows to every rank."""
    speculative = SpeculativeConfig(method="ngram", min_acceptance=0)
    return EngineConfig(
        model=model_dir, block_size=8, num_kv_blocks=96, tp=tp, speculative=speculative
    )


def requests() -> list[tuple[list[int], SamplingParams]]:
    """Greedy (one prompt that repeats itself, for ngram drafts), seeded sampling with n = 2,
    a beam search, DoLa and SLED: rank 0 samples; the other ranks compute early exits too."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 19, 12, 9, 14)]
    prompts[0] = [7, 8, 9, 10] * 4 + [7, 8]
    greedy = dict(max_tokens=7, ignore_eos=True)
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, temperature=0.8, seed=3, n=2),
        SamplingParams(max_tokens=5, ignore_eos=True, beam_width=3, n=2),
        SamplingParams(**greedy, dola_layers="high"),
        SamplingParams(**greedy, sled=True),
    ]
    return list(zip(prompts, params, strict=True))


def run_requests(engine: LLMEngine) -> dict[str, list]:
    """Each choice's tokens, and under "drafted" the draft tokens verified in all."""
    out: dict[str, list] = {"drafted": [0]}
    for i, (prompt, params) in enumerate(requests()):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(f"{o.request_id}/{o.index}", []).extend(o.new_token_ids)
            out["drafted"][0] += o.num_draft_tokens
    return out


def rank_main(rank: int, size: int, port: int, model_dir: str, kv: torch.Tensor, out: str):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        tp = TensorParallel(rank, size)
        config = engine_config(model_dir, size)
        executor = TorchExecutor(config, Path(model_dir), tp)
        blocks = [3, 9, 2]
        if rank:
            follow(executor, tp)
            # What this rank's own cache holds of the blocks rank 0 wrote: its heads' slice.
            torch.save(executor.read_kv(blocks, 0, kv.shape[0]), Path(f"{out}.rank{rank}"))
            return
        leader = LeaderExecutor(executor, tp)
        engine = LLMEngine(config, executor=leader)
        generated = run_requests(engine)
        engine.write_kv(blocks, 0, kv)
        whole = engine.read_kv(blocks, 0, kv.shape[0])
        top = engine.read_kv(blocks[1:], 1, kv.shape[0])
        leader.stop()
        torch.save((generated, whole, top, leader.bytes_per_block), Path(out))
    finally:
        dist.destroy_process_group()
