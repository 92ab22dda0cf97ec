"""`pdserve bench moe-tp`: a mixture-of-experts model on --tp ranks (one spawned process per
rank, Gloo on 127.0.0.1, each running the engine on its shard as a TP worker's rank actors
do), its MoE layers run both ways in the same run: each rank's experts on every token and an
all-reduce (the default), and --expert-parallel's all_to_all dispatch (expert_dispatch.py).

Prefill tokens/s: --batch fresh prompts of --prompt-len tokens, one new token each, over the
seconds of the whole batch. Decode tokens/s: the same batch run to --steps new tokens, less the
prefill-only run's seconds, over batch x (steps - 1) tokens. Best of --repeats, fresh prompts
every run (no prefix-cache hits), greedy with EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdserve.models.presets import WEIGHT_PRESETS

MODES = {"all-reduce": False, "all_to_all": True}  # name -> TensorParallel.expert_parallel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", choices=WEIGHT_PRESETS, default="small-moe", help="built-in model (small-moe)"
    )
    parser.add_argument("--model", default=None, help="an MoE model directory instead")
    parser.add_argument("--tp", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument("--batch", type=int, default=32, help="sequences (default: 32)")
    parser.add_argument("--prompt-len", type=int, default=128, help="(default: 128)")
    parser.add_argument("--steps", type=int, default=32, help="new tokens (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="best of (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")


def _seconds(engine, rng, shape: tuple[int, int], new_tokens: int) -> float:
    """Seconds the engine takes to give `new_tokens` to each of fresh prompts of `shape`."""
    from pdserve.core.sampling_params import SamplingParams

    prompts = rng.integers(3, engine.model_config["vocab_size"], shape).tolist()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def _measure_on_rank(rank: int, size: int, args: dict, model_dir: str, out: str) -> None:
    import numpy as np
    import torch

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig
    from pdserve.models.tensor_parallel import TensorParallel

    torch.set_num_threads(args["threads"])
    batch, prompt_len, steps = args["batch"], args["prompt_len"], args["steps"]
    rng = np.random.default_rng(0)  # the same prompts on every rank
    blocks = batch * (-(-(prompt_len + steps) // 16) + 1)
    results = {}
    for mode, expert_parallel in MODES.items():
        engine = LLMEngine(
            EngineConfig(
                model=model_dir,
                block_size=16,
                num_kv_blocks=blocks,
                max_num_seqs=batch,
                max_num_batched_tokens=batch * prompt_len,
                tp=size,
                expert_parallel=expert_parallel,
            ),
            tensor_parallel=TensorParallel(rank, size, expert_parallel=expert_parallel),
        )
        shape = (batch, prompt_len)
        _seconds(engine, rng, shape, 2)  # warm-up
        prefill = min(_seconds(engine, rng, shape, 1) for _ in range(args["repeats"]))
        whole = min(_seconds(engine, rng, shape, steps) for _ in range(args["repeats"]))
        results[mode] = {
            "prefill_tok_s": batch * prompt_len / prefill,
            "decode_tok_s": batch * (steps - 1) / max(whole - prefill, 1e-9),
        }
        del engine
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run(args: argparse.Namespace) -> int:
    import tempfile

    from pdserve.bench.common.spawned_ranks import run_on_ranks
    from pdserve.models.builtin import builtin_model_dir

    if args.tp < 2 or min(args.batch, args.prompt_len, args.repeats, args.threads) < 1:
        raise SystemExit("--tp must be at least 2; --batch, --prompt-len, --repeats, --threads 1+")
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (decode is the tokens after the first)")
    model_dir = args.model or str(builtin_model_dir(args.preset))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        sizes = {
            k: getattr(args, k) for k in ("batch", "prompt_len", "steps", "repeats", "threads")
        }
        run_on_ranks(args.tp, _measure_on_rank, (sizes, model_dir, out))
        results = json.loads(Path(out).read_text())
    print(
        f"{Path(model_dir).name} at TP {args.tp}, {args.threads} thread(s) a rank, batch "
        f"{args.batch}, prompts of {args.prompt_len}, {args.steps} new tokens"
    )
    print(f"{'MoE layers':<12} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for mode, r in results.items():
        print(f"{mode:<12} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}")
    base, ep = results["all-reduce"], results["all_to_all"]
    print(
        f"all_to_all / all-reduce: prefill {ep['prefill_tok_s'] / base['prefill_tok_s']:.2f}x, "
        f"decode {ep['decode_tok_s'] / base['decode_tok_s']:.2f}x"
    )
    return 0
