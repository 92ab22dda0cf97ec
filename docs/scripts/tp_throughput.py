"""CPU decode tokens/s of one worker at TP 2 against TP 1, the time rank 0 spends broadcasting
each command, and the bytes of one handoff's KV per rank, with the served worker's own
executors (pdserve/engine/tp_executor.py) over spawned Gloo ranks, one thread each.

    python docs/scripts/tp_throughput.py MODEL_DIR [BATCH]

(Kept out of pdserve/bench while that package is being reorganised; BENCHMARKS.md quotes it.)
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine import tp_executor
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import TorchExecutor
from pdserve.engine_config import EngineConfig
from pdserve.models.tensor_parallel import TensorParallel

PROMPT, TOKENS, BLOCK = 128, 64, 16


def config(model: str, tp: int, threads: int = 1) -> EngineConfig:
    return EngineConfig(
        model=model, block_size=BLOCK, num_kv_blocks=1024, tp=tp, num_threads=threads
    )


def decode_tokens_per_s(engine: LLMEngine, batch: int) -> float:
    """Decode tokens/s of `batch` requests once every prompt is computed."""
    gen = torch.Generator().manual_seed(0)
    vocab = engine.executor.vocab_size
    engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"r{i}", torch.randint(3, vocab, (PROMPT,), generator=gen).tolist(), params
        )
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in running
    ):
        engine.step()
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - started)


def rank(r: int, size: int, port: int, model: str, batch: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=size)
    tp = TensorParallel(r, size)
    executor = TorchExecutor(config(model, size), Path(model), tp)
    if r:
        tp_executor.follow(executor, tp)
        return
    spent = [0.0, 0]
    broadcast = tp_executor._broadcast

    def timed(command):
        started = time.perf_counter()
        result = broadcast(command)
        spent[0] += time.perf_counter() - started
        spent[1] += 1
        return result

    tp_executor._broadcast = timed
    leader = tp_executor.LeaderExecutor(executor, tp)
    tokens_per_s = decode_tokens_per_s(LLMEngine(config(model, size), executor=leader), batch)
    blocks = list(range(1, 1 + PROMPT // BLOCK))  # one PROMPT-token prompt's blocks
    own = executor.read_kv(blocks, 0, executor.num_layers)
    whole = leader.read_kv(blocks, 0, executor.num_layers)
    leader.stop()
    Path(out).write_text(
        f"TP {size}: {tokens_per_s:.1f} decode tok/s; broadcast {spent[0] / spent[1] * 1e3:.2f} "
        f"ms per command ({spent[1]} commands); {PROMPT}-token handoff: whole KV "
        f"{whole.nbytes} bytes, one rank's heads {own.nbytes} bytes"
    )


def main() -> None:
    model, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    for threads in (1, 2):
        torch.set_num_threads(threads)
        engine = LLMEngine(config(model, 1, threads))
        print(f"TP 1, {threads} thread(s): {decode_tokens_per_s(engine, batch):.1f} decode tok/s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path("/tmp") / f"tp_throughput_{port}.txt"
    mp.start_processes(rank, args=(2, port, model, batch, str(out)), nprocs=2, start_method="spawn")
    print(out.read_text())


if __name__ == "__main__":
    main()
