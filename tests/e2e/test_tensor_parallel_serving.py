"""Tensor-parallel workers served through the real router (Ray rank actors in a STRICT_PACK
placement group, Gloo between them on CPU): colocated at TP 2, and disaggregated with another
TP on each side of the KV handoff (P TP 2 -> D TP 1 and P TP 1 -> D TP 2 over nixl, P TP 2 ->
D TP 2 over the collective transport and over gRPC); greedy tokens equal
transformers' on a random-weight Qwen2 model with GQA. Each rank moves its own KV heads
(kv_transfer/tp_handoff.py): a failed or expired handoff leaves no block and no open part of a
transfer on any decode rank."""

from __future__ import annotations

import pytest
import torch

from pdserve.client import GenerationClient
from tests.models.hf_reference import hf_greedy
from tests.models.test_llama_matches_transformers import make_hf_model

pytest.importorskip("transformers")

_gen = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(3, 300, (n,), generator=_gen).tolist() for n in (3, 11, 30)]
MAX_TOKENS = 8

# (prefill workers, prefill TP, decode TP, disaggregated, KV transport). Each layout is an app
# of its own (~13 s here), so the heterogeneous directions run once, over nixl: the worker
# code is the same on every transport, and tests/kv_transfer/test_tp_handoff.py checks every
# transport's handoff byte for byte for every (P TP, D TP) in {1, 2, 4}^2 (grpc also serves
# P TP 2 -> D TP 2 below).
LAYOUTS = {
    "colocated-tp2": (0, 1, 2, False, "grpc"),
    "p-tp2-to-d-tp1-nixl": (1, 2, 1, True, "nixl"),
    "p-tp1-to-d-tp2-nixl": (1, 1, 2, True, "nixl"),
    "p-tp2-to-d-tp2-collective": (1, 2, 2, True, "collective"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-gqa")
    hf = make_hf_model(directory, "qwen2", num_key_value_heads=2)
    return str(directory), hf_greedy(hf, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tp_workers_serve_what_transformers_generates(ray_cluster, model, layout):
    from pdserve.app import BackgroundApp
    from tests.e2e.conftest import serve_config

    model_dir, expected = model
    prefill_workers, prefill_tp, decode_tp, disaggregated, transport = LAYOUTS[layout]
    config = serve_config(
        transport, prefill_workers=prefill_workers, decode_workers=1, prefill_tp=prefill_tp
    )
    config.decode_tp = decode_tp
    config.engine.model = model_dir
    config.router.disaggregate = "always" if disaggregated else "never"
    with BackgroundApp(config) as app, GenerationClient(f"127.0.0.1:{app.port}") as client:
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            completion = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
            assert completion.timings.disaggregated == disaggregated
            assert completion.choices[0].token_ids == tokens, prompt


def open_parts_on_other_ranks(app, worker_id: str) -> list[str]:
    """The transfer parts still open on the decode worker's ranks > 0 (their own endpoints).
    Its rank actors are named after rank 0's process (rank_group.py): earlier apps' are not
    counted."""
    import ray

    from pdserve.bench.common.system_probe import worker_pids

    prefix = f"pdserve-{worker_id}-rank"
    suffix = f"-{worker_pids(app)[worker_id]}"
    ranks = [
        ray.get_actor(actor["name"], namespace=actor["namespace"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(prefix) and actor["name"].endswith(suffix)
    ]
    assert ranks, f"no rank actors of {worker_id}"
    calls = [rank.kv_call.remote("open_transfer_ids") for rank in ranks]
    return [tid for open_ids in ray.get(calls) for tid in open_ids]


def test_failed_and_expired_tp_handoffs_leave_nothing_on_any_rank(ray_cluster, model):
    """P TP 2 -> D TP 2: a corrupted chunk fails the handoff (the request still completes
    exactly), a reservation expires unused; then no block is used and no decode rank holds an
    open part of a transfer."""
    import ray

    from pdserve.app import BackgroundApp
    from pdserve.core.messages import WorkRequest
    from pdserve.core.sampling_params import SamplingParams
    from tests.e2e.conftest import serve_config
    from tests.e2e.test_disaggregated_serving import all_workers_idle

    model_dir, expected = model
    config = serve_config("grpc", prefill_workers=1, decode_workers=1, prefill_tp=2)
    config.decode_tp = 2
    config.engine.model = model_dir
    config.worker.fault_injection = True
    with BackgroundApp(config) as app, GenerationClient(f"127.0.0.1:{app.port}") as client:
        prefill = app.app.pool.workers["prefill-0"].actor
        ray.get(prefill.inject_fault.remote("corrupt_next_chunk"))
        completion = client.generate(PROMPTS[2], max_tokens=MAX_TOKENS, ignore_eos=True)
        assert completion.choices[0].token_ids == expected[2]
        assert ray.get(prefill.stats.remote()).transfer_failures >= 1
        decode = app.app.pool.workers["decode-0"].actor
        work = WorkRequest("expiring", list(range(200, 220)), SamplingParams(max_tokens=4))
        reservation = ray.get(decode.reserve.remote(work, reservation_timeout_s=0.5))
        assert reservation is not None and len(reservation.rank_endpoints) == 2
        assert open_parts_on_other_ranks(app.app, "decode-0") == [reservation.transfer_id]
        assert all_workers_idle(app) == {"prefill-0": 0, "decode-0": 0}
        assert open_parts_on_other_ranks(app.app, "decode-0") == []
