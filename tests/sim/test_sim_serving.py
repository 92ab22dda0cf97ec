"""Sim workers behind the real router, Ray actors, Redis index and grpc KV transport: exact
tokens against the in-process sim engine, and worker processes that never import torch."""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from pdserve.config import KVTransferConfig, RouterConfig, ServeConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.pb import generate_pb2, generate_pb2_grpc
from tests.sim.conftest import sim_config


@pytest.fixture(scope="module")
def served(ray_cluster, sim_model_dir):
    from pdserve.app import BackgroundApp

    config = ServeConfig(
        engine=sim_config(sim_model_dir, num_kv_blocks=512, max_num_seqs=32),
        kv=KVTransferConfig(
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            reservation_timeout_s=20.0,
            trust_peer_cache=True,
        ),
        router=RouterConfig(host="127.0.0.1", port=0, http_port=0, disaggregate="always"),
        prefill_workers=1,
        decode_workers=1,
        prefill_engine="sim",
        decode_engine="sim",
    )
    with BackgroundApp(config) as app:
        yield app


@pytest.fixture()
def stub(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        yield generate_pb2_grpc.GenerationStub(channel)


def generate(stub, prompt: list[int], params: SamplingParams) -> list[int]:
    sampling = generate_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, seed=params.seed
    )
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampling
    )
    return [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]


def test_sim_workers_serve_the_in_process_sim_tokens(served, stub, sim_model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 10), temperature=0.7 * (i % 2), seed=i)
        for i in range(len(prompts))
    ]
    engine = LLMEngine(sim_config(sim_model_dir, num_kv_blocks=2048, max_num_seqs=64))
    expected = engine.generate(prompts, params)
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        served_tokens = list(pool.map(generate, [stub] * len(prompts), prompts, params))
    assert served_tokens == expected
    # Every handoff "sent" the modelled bytes of whole blocks.
    prefill = served.app.pool.of_role("prefill")[0].actor
    sent = ray.get(prefill.stats.remote()).transfer_bytes
    assert sent > 0 and sent % engine.bytes_per_block == 0


def test_sim_worker_processes_never_import_torch(served):
    handles = [w.actor for w in served.app.pool.workers.values()]
    assert len(handles) == 2
    imported = ray.get(
        [h.__ray_call__.remote(lambda self: "torch" in sys.modules) for h in handles]
    )
    assert imported == [False, False]
