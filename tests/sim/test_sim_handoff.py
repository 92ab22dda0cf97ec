"""Disaggregated sim workers: reserve -> payload-less KV transfer over grpc -> commit, through the
real PrefillWorker and DecodeWorker classes (without Ray), gives the colocated sim tokens."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest

from decode_service.worker import DecodeWorker
from kv_transfer import CommitInfo, KVLayout, KVTransferError, TransferRequest
from kv_transfer.grpc_receiver import GrpcKVReceiver
from kv_transfer.grpc_sender import GrpcKVSender
from pdserve.config import KVTransferConfig
from pdserve.core.messages import WorkRequest
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SimConfig
from pdserve.sim.kv import SimulatedKV
from pdserve.worker.worker_spec import WorkerSpec
from prefill_service.worker import PrefillWorker
from tests.decode_service.workers import drain, used_blocks
from tests.sim.conftest import sim_config

KV = KVTransferConfig(secret="sim-test-secret", bind_host="127.0.0.1", reservation_timeout_s=20.0)
PROMPT = list(range(10, 40))  # 7 full blocks of 4 and a partial one
PARAMS = SamplingParams(max_tokens=6, temperature=0.8, seed=11)


@contextlib.asynccontextmanager
async def sim_workers(engine: EngineConfig):
    decode = DecodeWorker("decode-0", WorkerSpec(engine=engine, kv=KV))
    prefill = PrefillWorker("prefill-0", WorkerSpec(engine=engine, kv=KV))
    await asyncio.gather(decode.ready(), prefill.ready())
    try:
        yield decode, prefill
    finally:
        decode._receiver.stop()
        prefill._sender.close()
        for worker in (decode, prefill):
            await asyncio.to_thread(worker._runtime.shutdown)


def test_a_sim_handoff_decodes_like_the_colocated_sim_engine(sim_model_dir):
    engine = sim_config(sim_model_dir)
    colocated = LLMEngine(dataclasses.replace(engine)).generate([PROMPT], PARAMS)[0]

    async def scenario() -> None:
        async with sim_workers(engine) as (decode, prefill):
            work = WorkRequest("a", PROMPT, PARAMS)
            reservation = await decode.reserve(work)
            *_, result = [r async for r in prefill.prefill(work, reservation)]
            rest = [t for batch in await drain(decode, "a") for t in batch.token_ids]
            assert [result.first_token_id, *rest] == colocated
            # The modelled bytes of every block were "sent", none of them moved.
            stats = await prefill.stats()
            blocks = len(reservation.missing_block_indices)
            assert blocks == 8 and stats.transfer_bytes == blocks * stats.bytes_per_block
            # The prefill step's modelled and measured time reach the worker's stats.
            assert 0 < stats.sim_modelled_seconds <= stats.sim_measured_seconds
            for worker in (decode, prefill):
                await worker.abort("a")
                assert await used_blocks(worker) == 0

    asyncio.run(scenario())


def test_a_sim_transfer_takes_its_bytes_over_the_link_bandwidth(sim_model_dir):
    # 1 Gbit/s: a block of the 8B shape in bfloat16 (4 tokens x 128 KiB) takes ~4.2 ms.
    engine = sim_config(sim_model_dir, sim=SimConfig(time_scale=1.0, link_gbps=1.0))
    blocks = 8

    async def scenario() -> None:
        async with sim_workers(engine) as (decode, prefill):
            work = WorkRequest("b", list(range(3, 3 + 4 * blocks)), SamplingParams(max_tokens=2))
            reservation = await decode.reserve(work)
            _ = [r async for r in prefill.prefill(work, reservation)]
            stats = await prefill.stats()
            modelled = stats.transfer_bytes / (1e9 / 8)
            assert stats.transfer_bytes == blocks * stats.bytes_per_block
            assert modelled <= stats.transfer_seconds < modelled + 1.0
            await drain(decode, "b")

    asyncio.run(scenario())


class RecordingSink:
    def __init__(self) -> None:
        self.writes: list = []
        self.commits: list = []
        self.expired: list = []

    def write_kv(self, transfer_id, block_ids, layer_start, data, head_start) -> None:
        self.writes.append(data)

    def on_commit(self, transfer_id, commit) -> None:
        self.commits.append(commit)

    def on_expired(self, transfer_id) -> None:
        self.expired.append(transfer_id)


def simulated_read_kv(block_ids: list[int], l0: int, l1: int) -> SimulatedKV:
    return SimulatedKV((l1 - l0, 2, len(block_ids), 4, 8, 128), "bfloat16", 2)


@pytest.mark.parametrize("device", ["sim", "cpu"])
def test_only_a_sim_cache_accepts_payload_less_chunks(device):
    layout = KVLayout(num_layers=32, block_size=4, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16", device=device)  # fmt: skip
    sink = RecordingSink()
    receiver = GrpcKVReceiver(KV, sink, layout)
    endpoint = receiver.start()
    sender = GrpcKVSender(KV)
    try:
        transfer_id = receiver.open([5, 6, 7])
        request = TransferRequest(
            endpoint, transfer_id, [1, 2, 3], 32, simulated_read_kv, CommitInfo(42)
        )
        if device == "cpu":
            with pytest.raises(KVTransferError, match="payload is 0 bytes"):
                sender.send(request)
            deadline = time.monotonic() + 5
            while not sink.expired and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sink.expired == [transfer_id] and not sink.writes and not sink.commits
        else:
            result = sender.send(request)
            assert result.bytes == 32 * 2 * 3 * 4 * 8 * 128 * 2
            assert [w.shape[0] for w in sink.writes] and sum(w.shape[0] for w in sink.writes) == 32
            assert all(isinstance(w, SimulatedKV) for w in sink.writes)
            assert [c.first_token_id for c in sink.commits] == [42]
    finally:
        sender.close()
        receiver.stop()
