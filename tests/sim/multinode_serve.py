"""Serves sim workers through a multi-node Ray cluster formed on this machine and prints, as one
JSON line, what tests/sim/test_multinode.py checks. Runs in its own process: Ray allows one
cluster per process and the test session already has one.

python -m tests.sim.multinode_serve MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import ray
from ray.cluster_utils import Cluster

from pdserve.app import BackgroundApp
from pdserve.config import KVTransferConfig, RouterConfig, ServeConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.pb import generate_pb2, generate_pb2_grpc
from tests.sim.conftest import sim_config

PROMPTS = [[5, 9, 100, 7], list(range(20, 57)), [300] * 9, list(range(900, 880, -1))]
MAX_TOKENS = [6, 3, 8, 5]


def generate(port: int, prompt: list[int], max_tokens: int) -> list[int]:
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]


def serve_through_cluster(model_dir: Path) -> dict:
    """Head without pool resources, one node with `prefill_pool`, one with `decode_pool`."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    prefill_node = cluster.add_node(num_cpus=1, resources={"prefill_pool": 1})
    decode_node = cluster.add_node(num_cpus=1, resources={"decode_pool": 1})
    cluster.wait_for_nodes()
    node_ids = {
        "head": cluster.head_node.node_id,
        "prefill": prefill_node.node_id,
        "decode": decode_node.node_id,
    }
    config = ServeConfig(
        engine=sim_config(model_dir, num_kv_blocks=256, max_num_seqs=8),
        kv=KVTransferConfig(bind_host="127.0.0.1", advertise_host="127.0.0.1"),
        router=RouterConfig(host="127.0.0.1", port=0, http_port=0, disaggregate="always"),
        ray_address=cluster.address,
        prefill_workers=1,
        decode_workers=1,
        prefill_engine="sim",
        decode_engine="sim",
    )
    try:
        with BackgroundApp(config) as served:
            with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
                tokens = list(pool.map(generate, [served.port] * len(PROMPTS), PROMPTS, MAX_TOKENS))
            workers = served.app.pool.workers
            actor_nodes = {
                worker_id: ray.get(
                    w.actor.__ray_call__.remote(
                        lambda self: ray.get_runtime_context().get_node_id()
                    )
                )
                for worker_id, w in workers.items()
            }
            sent = ray.get(served.app.pool.of_role("prefill")[0].actor.stats.remote())
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {
        "tokens": tokens,
        "actor_nodes": actor_nodes,
        "node_ids": node_ids,
        "transfer_bytes": sent.transfer_bytes,
    }


def in_process_tokens(model_dir: Path) -> list[list[int]]:
    engine = LLMEngine(sim_config(model_dir, num_kv_blocks=256, max_num_seqs=8))
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS]
    return engine.generate(PROMPTS, params)


if __name__ == "__main__":
    model = Path(sys.argv[1])
    result = serve_through_cluster(model)
    result["expected"] = in_process_tokens(model)
    print(json.dumps(result))
