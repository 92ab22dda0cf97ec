"""A real local Ray cluster and a served system (router + worker actors) shared by e2e tests."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from pdserve.config import KVTransferConfig, RouterConfig, ServeConfig
from pdserve.engine_config import EngineConfig
from pdserve.pb import generate_pb2_grpc

# Small enough for 2 CI cores; large enough that 32 concurrent requests never run out of blocks.
ENGINE = EngineConfig(
    block_size=4, num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=256, num_threads=1
)


def serve_config(transport: str = "grpc", **overrides) -> ServeConfig:
    config = ServeConfig(
        engine=dataclasses.replace(ENGINE),
        kv=KVTransferConfig(
            transport=transport,
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            reservation_timeout_s=20.0,
            # Received KV enters the decode prefix caches (asserted by the prefix-hit test).
            trust_peer_cache=True,
        ),
        router=RouterConfig(host="127.0.0.1", port=0, http_port=0, disaggregate="always"),
        prefill_workers=2,
        decode_workers=2,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module", params=["grpc", "collective", "nixl"])
def served(request, ray_cluster):
    from pdserve.app import BackgroundApp

    config = serve_config(request.param)
    config.worker.fault_injection = True  # lets tests arm PrefillWorker.inject_fault
    with BackgroundApp(config) as app:
        yield app


@pytest.fixture()
def stub(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        yield generate_pb2_grpc.GenerationStub(channel)
