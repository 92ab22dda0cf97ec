"""A decode and a prefill worker in this process, without Ray: the actor classes on one event
loop, a real engine each and a real KV endpoint on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from decode_service.worker import DecodeWorker
from pdserve.config import KVTransferConfig
from pdserve.core.messages import TokenBatch
from pdserve.engine_config import EngineConfig
from pdserve.worker.worker_spec import WorkerSpec
from prefill_service.worker import PrefillWorker

ENGINE = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=256, num_threads=1)
KV = KVTransferConfig(
    secret="decode-test-secret", bind_host="127.0.0.1", reservation_timeout_s=20.0
)


@contextlib.asynccontextmanager
async def running_workers(
    decode_kv: dict | None = None,
    prefill_kv: dict | None = None,
    decode_engine: dict | None = None,
    **both,
) -> AsyncIterator[tuple[DecodeWorker, PrefillWorker]]:
    """KV settings: `both` for both workers, plus `decode_kv` / `prefill_kv` for one;
    `decode_engine`: EngineConfig settings of the decode worker."""
    kv = {"decode": {**both, **(decode_kv or {})}, "prefill": {**both, **(prefill_kv or {})}}
    decode = DecodeWorker("decode-0", spec(decode_engine, **kv["decode"]))
    prefill = PrefillWorker("prefill-0", spec(None, **kv["prefill"]))
    await asyncio.gather(decode.ready(), prefill.ready())
    try:
        yield decode, prefill
    finally:
        decode._receiver.stop()
        prefill._sender.close()
        for worker in (decode, prefill):
            await asyncio.to_thread(worker._runtime.shutdown)


def spec(engine_overrides: dict | None = None, **kv_overrides) -> WorkerSpec:
    return WorkerSpec(
        engine=dataclasses.replace(ENGINE, **(engine_overrides or {})),
        kv=dataclasses.replace(KV, **kv_overrides),
    )


async def drain(decode: DecodeWorker, request_id: str) -> list[TokenBatch]:
    return [batch async for batch in decode.stream(request_id)]


async def used_blocks(worker: DecodeWorker | PrefillWorker) -> int:
    return (await worker.stats()).num_used_blocks
