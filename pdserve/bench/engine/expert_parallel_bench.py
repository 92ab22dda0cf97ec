"""`pdserve bench moe-tp`: a mixture-of-experts model on --tp ranks (one spawned process per
rank, Gloo on 127.0.0.1, each running the engine on its shard as a TP worker's rank actors
do), its MoE layers run both ways in the same run: each rank's experts on every token and an
all-reduce (the default), and --expert-parallel's all_to_all dispatch (expert_dispatch.py).

Prefill tokens/s: --batch fresh prompts of --prompt-len tokens over the seconds of the step
that prefills them all. Decode tokens/s: batch x (--steps - 1) over the seconds of the steps
after it. Best of --repeats, the two modes measured in turn on each, fresh prompts every run
(no prefix-cache hits), greedy with EOS ignored.
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
    parser.add_argument("--repeats", type=int, default=5, help="best of (default: 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")


def _timed(engine, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Seconds of the prefill step (the whole batch in one step) and of the decode steps after
    it, each prompt given `steps` new tokens."""
    from pdserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"moe-tp-{time.perf_counter()}-{i}", prompt, params)
    start = time.perf_counter()
    engine.step()
    prefilled = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return prefilled - start, time.perf_counter() - prefilled


def _measure_on_rank(rank: int, size: int, args: dict, model_dir: str, out: str) -> None:
    """Both modes' engines loaded side by side, measured in turn on each repeat (the load of a
    shared machine then weighs on both alike); rank 0 writes the best of each."""
    import numpy as np
    import torch

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig
    from pdserve.models.tensor_parallel import TensorParallel

    torch.set_num_threads(args["threads"])
    batch, prompt_len, steps = args["batch"], args["prompt_len"], args["steps"]
    rng = np.random.default_rng(0)  # the same prompts on every rank
    engines = {
        mode: LLMEngine(
            EngineConfig(
                model=model_dir,
                block_size=16,
                num_kv_blocks=batch * (-(-(prompt_len + steps) // 16) + 1),
                max_num_seqs=batch,
                max_num_batched_tokens=batch * prompt_len,
                tp=size,
                expert_parallel=expert_parallel,
            ),
            tensor_parallel=TensorParallel(rank, size, expert_parallel=expert_parallel),
        )
        for mode, expert_parallel in MODES.items()
    }
    vocab = next(iter(engines.values())).model_config["vocab_size"]
    best = {mode: [float("inf"), float("inf")] for mode in MODES}
    for repeat in range(args["repeats"] + 1):  # the first: warm-up
        for mode, engine in engines.items():
            prompts = rng.integers(3, vocab, (batch, prompt_len)).tolist()  # fresh: no hits
            seconds = _timed(engine, prompts, steps)
            if repeat:
                best[mode] = [min(b, s) for b, s in zip(best[mode], seconds, strict=True)]
    results = {
        mode: {
            "prefill_tok_s": batch * prompt_len / prefill,
            "decode_tok_s": batch * (steps - 1) / decode,
        }
        for mode, (prefill, decode) in best.items()
    }
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
