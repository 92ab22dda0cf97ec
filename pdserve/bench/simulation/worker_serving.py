"""One worker's engine served in this process, as a serving worker runs it (`bench
fidelity-worker`): the engine on its own thread behind `EngineLoop`, requests added between
steps, each step's tokens stamped where the worker's token stream hands them on; no Ray, gRPC
or Redis, so it runs where only torch is installed."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.simulation.fidelity_bench import decode_pace, run_summary


def engine(args: argparse.Namespace, model_dir: Path, sim: Any = None) -> Any:
    """The real worker's engine, or with `sim` (a SimConfig) the sim worker's: the same limits."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig

    limits = {
        "model": str(model_dir),
        "block_size": 16,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "dtype": args.dtype,
    }
    if sim is not None:
        config = EngineConfig(**limits, kind="sim", sim=sim)
    else:
        config = EngineConfig(
            **limits, device=args.device, compile=args.compile, async_scheduling=False
        )
    # As the serving workers run it (pdserve/worker/worker_runtime.py): token ids out.
    return LLMEngine(config, emit_text=False)


@contextlib.contextmanager
def served(llm_engine: Any) -> Any:
    """`llm_engine` on its own thread behind an EngineLoop bound to the running event loop."""
    from pdserve.worker.engine_loop import EngineLoop

    loop = EngineLoop(llm_engine, asyncio.get_running_loop())
    try:
        yield loop
    finally:
        loop.stop()


async def serve(loop: Any, requests: list, rate: float, seed: int) -> list:
    """The records of `requests` sent open-loop (Poisson) at `rate`, from a cold
    prefix cache: each run of the same requests finds what its own requests cached, no more."""
    from pdserve.bench.common.load_generator import drive

    await loop.acall(loop.engine.block_manager.reset_prefix_cache)

    async def send(request: Any, record: Any, slots: Any, on_done: Callable) -> None:
        async with slots or contextlib.nullcontext():
            await send_one(loop, request, record)
            on_done(record)

    return await drive(requests, send, request_rate=rate, seed=seed)


async def served_summary(loop: Any, requests: list, rate: float, seed: int) -> dict:
    """`bench fidelity`'s summary of one run (with the decode pace after the second token)."""
    records = await serve(loop, requests, rate, seed)
    return {**run_summary(records), "decode_pace": decode_pace(records)}


async def send_one(loop: Any, request: Any, record: Any) -> None:
    """One request through the worker's engine loop, each step's tokens stamped as they reach
    this consumer (what a worker's token stream hands on)."""
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.worker.engine_loop import END_OF_STREAM

    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
    stream = loop.open_stream(record.request_id)
    record.send_time = time.perf_counter()
    await loop.acall(lambda: loop.engine.add_request(record.request_id, request.prompt, params))
    while True:
        item = await stream.get()
        now = time.perf_counter()
        if item is END_OF_STREAM:
            record.error_code, record.error = "FINISH_ABORT", loop.failure or "aborted"
            break
        if item.new_token_ids:
            record.chunk_times.append(now)
            record.chunk_tokens.append(len(item.new_token_ids))
        if item.ends_request:
            record.finish_reason = item.finish_reason
            record.ok = item.finish_reason in ("stop", "length")
            break
    record.end_time = time.perf_counter()


def pacing(engine: Any) -> dict[str, float]:
    from pdserve.bench.simulation.fidelity_calibration import PACING

    stats = engine.executor.stats()
    return {key: stats.get(key, 0.0) for key in PACING}
