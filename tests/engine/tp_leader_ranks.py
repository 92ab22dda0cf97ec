"""Rank processes of one tensor-parallel worker as the server runs it, without Ray (spawned,
spawned_ranks.run_on_ranks): rank 0 runs the engine on a LeaderExecutor, the other ranks
`follow` it (pdserve/engine/tp_executor.py). Rank 0 writes what it generated to a file."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import TorchExecutor
from pdserve.engine.tp_executor import LeaderExecutor, follow
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.tensor_parallel import TensorParallel


def engine_config(model_dir: str, tp: int, draft_dir: str | None = None) -> EngineConfig:
    """Speculative, never paused (verify steps carry draft rows to every rank): ngram, or
    draft-model speculation with the draft in `draft_dir` (it runs whole on rank 0)."""
    if draft_dir is None:
        speculative = SpeculativeConfig(method="ngram", min_acceptance=0)
    else:
        speculative = SpeculativeConfig(method="draft", draft_model=draft_dir, min_acceptance=0)
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


def rank_work(rank: int, size: int, model_dir: str, draft_dir: str | None, out: str) -> None:
    """One rank's part, in spawned_ranks.run_on_ranks' Gloo group."""
    tp = TensorParallel(rank, size)
    config = engine_config(model_dir, size, draft_dir)
    executor = TorchExecutor(config, Path(model_dir), tp)
    if rank:
        follow(executor, tp)
    else:
        leader = LeaderExecutor(executor, tp)
        engine = LLMEngine(config, executor=leader)
        generated = run_requests(engine)
        leader.stop()
        torch.save((generated, leader.bytes_per_block), Path(out))
