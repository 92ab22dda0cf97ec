"""A sim worker with host and disk tiers (--engine sim --kv-offload-gb --kv-disk-gb) behind the
real router, Ray and Redis: a multi-turn chat over its device pool gets the in-process sim
engine's tokens, and later turns come back from the tiers instead of being recomputed."""

from __future__ import annotations

import random

import grpc
import ray

from pdserve.config import KVTransferConfig, RouterConfig, ServeConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.pb import generate_pb2, generate_pb2_grpc
from tests.sim.conftest import sim_config

DEVICE_BLOCKS = 48  # block size 4: about two conversations; the chat holds six
PARAMS = SamplingParams(max_tokens=4)


def generate(stub, prompt: list[int]) -> list[int]:
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=PARAMS.max_tokens),
    )
    return [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]


def chat(send) -> list[list[int]]:
    """Six conversations, three turns each, taken in turn: each one's past leaves the device
    pool before its next turn."""
    rng = random.Random(5)
    history = [[rng.randrange(5, 1000) for _ in range(40)] for _ in range(6)]
    outputs = []
    for _ in range(3):
        for conversation in history:
            conversation += [rng.randrange(5, 1000) for _ in range(8)]
            output = send(list(conversation))
            outputs.append(output)
            conversation += output
    return outputs


def test_a_sim_worker_with_tiers_serves_exact_tokens_from_its_tiers(ray_cluster, sim_model_dir):
    from pdserve.app import BackgroundApp

    reference = LLMEngine(sim_config(sim_model_dir, num_kv_blocks=1024))
    block_gib = reference.bytes_per_block / 2**30
    engine = sim_config(
        sim_model_dir,
        num_kv_blocks=DEVICE_BLOCKS,
        kv_offload_gb=24 * block_gib,
        kv_disk_gb=64 * block_gib,
    )
    config = ServeConfig(
        engine=engine,
        kv=KVTransferConfig(bind_host="127.0.0.1", advertise_host="127.0.0.1"),
        router=RouterConfig(host="127.0.0.1", port=0, http_port=0, disaggregate="never"),
        prefill_workers=0,
        decode_workers=1,
    )
    expected = chat(lambda prompt: reference.generate([prompt], PARAMS)[0])
    with BackgroundApp(config) as app:
        with grpc.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            served = chat(lambda prompt: generate(stub, prompt))
        worker = app.app.pool.of_role("decode")[0].actor
        stats = ray.get(worker.stats.remote())
    assert served == expected
    assert (stats.num_host_blocks, stats.num_disk_blocks) == (24, 64)
    hits = (stats.prefix_host_hit_tokens, stats.prefix_disk_hit_tokens)
    assert hits[0] > 0 and hits[1] > 0, hits
    assert stats.host_copy_bytes_per_s == 50 * 10**9  # the modelled link the router prices
