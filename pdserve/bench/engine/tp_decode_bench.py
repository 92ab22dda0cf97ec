"""`pdserve bench tp-decode`: decode tokens/s of one worker at --tp ranks against TP 1 (on one
thread, and on as many threads as ranks), in the same run, with the served worker's own
executors (pdserve/engine/tp_executor.py: `LeaderExecutor` on rank 0, `follow` on the others)
over spawned Gloo ranks of one thread each; also the time rank 0 spends broadcasting each
command, and the bytes of one prompt's KV whole (TP 1) and one rank's heads (what each rank
sends in a handoff).

    pdserve bench tp-decode [--preset small | --model DIR] [--tp 2] [--batch 8]
        [--prompt-len 128] [--tokens 64] [--json FILE]

Decode tokens/s: --batch requests of --prompt-len random tokens, --tokens new tokens each
(greedy, EOS ignored), counted once every prompt is computed, after a short warm-up request.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pdserve.models.presets import WEIGHT_PRESETS

BLOCK = 16  # tokens per block
KV_BLOCKS = 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=WEIGHT_PRESETS, default="small", help="built-in model")
    p.add_argument("--model", default=None, help="a model directory instead")
    p.add_argument("--tp", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--batch", type=int, default=8, help="requests (default: 8)")
    p.add_argument("--prompt-len", type=int, default=128, help="(default: 128)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request (default: 64)")
    p.add_argument("--json", help="write every figure and the ratios to this file")


def _config(model: str, tp: int, threads: int) -> Any:
    from pdserve.engine_config import EngineConfig

    return EngineConfig(
        model=model, block_size=BLOCK, num_kv_blocks=KV_BLOCKS, tp=tp, num_threads=threads
    )


def decode_tokens_per_s(engine: Any, sizes: dict[str, int]) -> float:
    """Decode tokens/s of `sizes["batch"]` requests once every prompt is computed."""
    import torch

    from pdserve.core.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    vocab = engine.executor.vocab_size
    engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(max_tokens=sizes["tokens"], ignore_eos=True)
    for i in range(sizes["batch"]):
        prompt = torch.randint(3, vocab, (sizes["prompt_len"],), generator=gen).tolist()
        engine.add_request(f"tp-decode-{i}", prompt, params)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in running
    ):
        engine.step()
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - started)


def _prompt_blocks(sizes: dict[str, int]) -> list[int]:
    """A prompt's full blocks (which ones does not matter: their bytes are counted)."""
    return list(range(1, 1 + sizes["prompt_len"] // BLOCK))


def _measure_on_rank(rank: int, size: int, model: str, sizes: dict[str, int], out: str) -> None:
    """Rank 0 runs the engine over a LeaderExecutor, counting its broadcasts' time, and
    writes the figures; the other ranks follow until it stops."""
    from pdserve.engine import tp_executor
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.model_runner import TorchExecutor
    from pdserve.models.tensor_parallel import TensorParallel

    tp = TensorParallel(rank, size)
    executor = TorchExecutor(_config(model, size, 1), Path(model), tp)
    if rank:
        tp_executor.follow(executor, tp)
        return
    spent = [0.0, 0]  # seconds, commands
    broadcast = tp_executor._broadcast

    def timed(command):
        started = time.perf_counter()
        result = broadcast(command)
        spent[0] += time.perf_counter() - started
        spent[1] += 1
        return result

    tp_executor._broadcast = timed  # this process's rank 0 only
    leader = tp_executor.LeaderExecutor(executor, tp)
    tokens_per_s = decode_tokens_per_s(LLMEngine(_config(model, size, 1), executor=leader), sizes)
    own = executor.read_kv(_prompt_blocks(sizes), 0, executor.num_layers)
    leader.stop()
    figures = {
        "tokens_per_s": tokens_per_s,
        "broadcast_ms": spent[0] / spent[1] * 1e3,
        "commands": spent[1],
        "rank_handoff_bytes": own.nbytes,
    }
    Path(out).write_text(json.dumps(figures))


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from pdserve.bench.common.spawned_ranks import run_on_ranks
    from pdserve.engine.engine import LLMEngine
    from pdserve.models.builtin import builtin_model_dir

    if args.tp < 2:
        raise SystemExit("--tp must be at least 2 (TP 1 is the baseline)")
    if min(args.batch, args.prompt_len, args.tokens) < 1:
        raise SystemExit("--batch, --prompt-len, --tokens must be at least 1")
    model = args.model or str(builtin_model_dir(args.preset))
    sizes = {"batch": args.batch, "prompt_len": args.prompt_len, "tokens": args.tokens}
    threads = dict.fromkeys((1, args.tp))
    for n in threads:
        torch.set_num_threads(n)
        engine = LLMEngine(_config(model, 1, n))
        threads[n] = decode_tokens_per_s(engine, sizes)
    whole = engine.read_kv(_prompt_blocks(sizes), 0, engine.num_layers).nbytes
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        run_on_ranks(args.tp, _measure_on_rank, (model, sizes, out))
        tp = json.loads(Path(out).read_text())
    print(
        f"{Path(model).name}, {args.batch} requests of {args.prompt_len} prompt tokens, "
        f"{args.tokens} new tokens each: decode tok/s"
    )
    for n, tokens_per_s in threads.items():
        print(f"TP 1, {n} thread(s): {tokens_per_s:.1f}")
    print(
        f"TP {args.tp} ({args.tp} ranks x 1 thread): {tp['tokens_per_s']:.1f}; rank 0's "
        f"broadcast {tp['broadcast_ms']:.2f} ms per command ({tp['commands']} commands)"
    )
    ratios = {
        f"tp{args.tp}_over_tp1_{n}_threads": tp["tokens_per_s"] / t for n, t in threads.items()
    }
    print(
        f"TP {args.tp} / TP 1: "
        + ", ".join(f"{tp['tokens_per_s'] / t:.2f}x ({n} thread(s))" for n, t in threads.items())
    )
    print(
        f"{args.prompt_len}-token handoff: whole KV {whole} bytes, one rank's "
        f"heads {tp['rank_handoff_bytes']} bytes"
    )
    if args.json:
        tp1 = {str(n): t for n, t in threads.items()}
        figures = {"tp1_tokens_per_s": tp1, "handoff_bytes": whole, **tp, **ratios}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0
