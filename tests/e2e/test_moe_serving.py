"""A mixture-of-experts model served disaggregated over every KV transport: MoE changes only
the MLP, so KV transfer and the prefix caches work unchanged and the tokens are transformers'."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from prometheus_client import REGISTRY

from pdserve.pb import generate_pb2_grpc
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import collect, request, run_concurrently
from tests.models.hf_reference import hf_greedy
from tests.models.test_llama_matches_transformers import VOCAB, make_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-moe")
    return directory, make_hf_model(directory, "qwen3-moe-top2")


@pytest.mark.parametrize("transport", ["grpc", "collective", "nixl"])
def test_qwen3_moe_served_prefill_to_decode_gives_transformers_tokens(
    ray_cluster, qwen3_moe, transport
):
    import ray

    from pdserve.app import BackgroundApp

    directory, hf = qwen3_moe
    config = serve_config(transport, prefill_workers=1, decode_workers=1)
    config.engine = dataclasses.replace(config.engine, model=str(directory))
    system = [(7 * i) % (VOCAB - 10) + 5 for i in range(20)]  # a shared prefix of 5 blocks
    prompts = [system + [11, 12, 13], system + [200, 201], [40, 41, 42, 43, 44]]
    expected = hf_greedy(hf, prompts, 6)
    with BackgroundApp(config) as served, grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        first = collect(stub, request(prompts[0], 6))  # warms both prefix caches
        answers = [first, *run_concurrently(stub, prompts[1:], [6, 6])]
        stats = {
            w.worker_id: ray.get(w.actor.stats.remote()) for w in served.app.pool.workers.values()
        }
        hits = {worker: s.prefix_hit_tokens for worker, s in stats.items()}
        served.run(served.app.pool.poll_once(), timeout=30)  # the router exports them
    assert [tokens for tokens, _ in answers] == expected
    last = [responses[-1] for _, responses in answers]
    assert all(r.timings.disaggregated for r in last)
    assert last[1].usage.cached_prompt_tokens >= 16  # the shared prefix's full blocks
    assert all(n > 0 for n in hits.values()), hits  # on the prefill and the decode worker
    # The load per expert: 2 sparse layers x top-2 routings per computed token, exported.
    for worker, s in stats.items():
        assert len(s.expert_tokens) == 5 and sum(s.expert_tokens) % 4 == 0, worker
        assert s.expert_load_imbalance >= 1.0
        exported = [
            REGISTRY.get_sample_value(
                "pdserve_expert_tokens_total", {"worker": worker, "expert": str(e)}
            )
            or 0
            for e in range(5)
        ]
        assert sum(exported) > 0, worker


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["all-reduce", "all_to_all"])
def test_qwen3_moe_on_tp2_workers_gives_transformers_tokens(
    ray_cluster, qwen3_moe, expert_parallel
):
    """Prefill and decode workers of TP 2 each (P->D over gRPC), with each rank's experts run
    on every token and all-reduced (the default) or --expert-parallel's all_to_all dispatch.
    Each worker counts every computed token's routings once, not once per rank."""
    import ray

    from pdserve.app import BackgroundApp

    directory, hf = qwen3_moe
    config = serve_config("grpc", prefill_workers=1, decode_workers=1, prefill_tp=2, decode_tp=2)
    config.engine = dataclasses.replace(config.engine, model=str(directory))
    config.expert_parallel = expert_parallel
    prompts = [[40, 41, 42, 43, 44], [(5 * i) % (VOCAB - 10) + 5 for i in range(13)], [9]]
    expected = hf_greedy(hf, prompts, 6)
    with BackgroundApp(config) as served, grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        answers = [collect(stub, request(prompt, 6)) for prompt in prompts]
        stats = [ray.get(w.actor.stats.remote()) for w in served.app.pool.workers.values()]
    assert [tokens for tokens, _ in answers] == expected
    assert all(responses[-1].timings.disaggregated for _, responses in answers)
    for s in stats:  # 2 sparse layers x top-2 per token the worker computed
        computed = s.prefill_tokens + s.decode_tokens
        assert computed > 0 and sum(s.expert_tokens) == 4 * computed, s.worker_id
