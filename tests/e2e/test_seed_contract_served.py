"""The seed contract served (real Ray workers, gRPC KV transfer, Redis) on a speculating system
with its switch-off on (prompt lookup, and a draft model): seeded temperature-only, top-k, top-p,
top-k + top-p and min-p requests give a plain engine's tokens, alone three times and batched with
every other kind; a seeded request whose decode worker is killed mid-stream gives its
uninterrupted run's tokens (the router's retry continues the stream)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.client import GenerationClient
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine_config import SpeculativeConfig
from tests.e2e.conftest import ENGINE, serve_config

PERIODIC = [5, 17, 99, 23, 42, 7] * 4  # prompt lookup finds something to propose
LENGTH = {"max_tokens": 24, "ignore_eos": True}
KINDS = {
    "temperature": {"temperature": 0.9, "seed": 1},
    "top_k": {"temperature": 1.0, "top_k": 12, "seed": 2},
    "top_p": {"temperature": 0.6, "top_p": 0.8, "seed": 3},
    "top_k_top_p": {"temperature": 1.2, "top_k": 40, "top_p": 0.9, "seed": 4},
    "min_p": {"temperature": 1.0, "min_p": 0.1, "seed": 6},
}
OTHERS = [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.95}]  # greedy, unseeded
KILLED = {"temperature": 0.9, "top_k": 40, "seed": 5, "max_tokens": 120, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir():
    from pdserve.models.builtin import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def plain(model_dir):
    """plain(prompt, fields) -> a non-speculative engine's tokens."""
    from pdserve.engine.engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(ENGINE, model=str(model_dir)))
    return lambda prompt, fields: engine.generate([prompt], SamplingParams(**fields))[0]


@pytest.fixture(scope="module", params=["ngram", "draft"])
def served(request, ray_cluster, model_dir, tmp_path_factory):
    from pdserve.app import BackgroundApp
    from pdserve.models.draft_of import write_draft_of

    draft = None
    if request.param == "draft":
        draft = write_draft_of(model_dir, tmp_path_factory.mktemp("draft"))[0]
    config = serve_config("grpc", prefill_workers=1, decode_workers=2)
    config.engine.speculative = SpeculativeConfig(
        method=request.param,
        draft_model=None if draft is None else str(draft),
        num_speculative_tokens=4,
        min_acceptance=0.4,  # the switch-off on: whether a step verifies varies run to run
    )
    with BackgroundApp(config) as app:
        yield app


def prompt_of(i: int) -> list[int]:
    return PERIODIC[i:] + PERIODIC[:i]


def test_seeded_kinds_alone_and_batched_give_the_plain_engines_tokens(served, plain):
    expected = {
        kind: plain(prompt_of(i), {**fields, **LENGTH})
        for i, (kind, fields) in enumerate(KINDS.items())
    }
    with GenerationClient(f"127.0.0.1:{served.port}") as client:
        for _ in range(3):
            for i, (kind, fields) in enumerate(KINDS.items()):
                got = client.generate(prompt_of(i), **fields, **LENGTH).token_ids
                assert got == expected[kind], kind
        everyone = [*KINDS.values(), *OTHERS]
        with ThreadPoolExecutor(len(everyone)) as pool:  # batched together on a decode worker
            outputs = list(
                pool.map(
                    lambda job: client.generate(prompt_of(job[0]), **job[1], **LENGTH),
                    enumerate(everyone),
                )
            )
    for kind, output in zip(KINDS, outputs, strict=False):
        assert output.token_ids == expected[kind], kind


def test_a_seeded_request_killed_mid_stream_gives_its_uninterrupted_run(served, plain):
    import ray

    prompt = prompt_of(3)
    expected = plain(prompt, KILLED)
    with GenerationClient(f"127.0.0.1:{served.port}") as client:
        stream = client.generate_stream(prompt, **KILLED)
        # Two chunks: the prefill worker's first token, then the decode worker's own stream
        # (test_router_api.py's failover test says why).
        sent = [next(stream), next(stream)]
        victim = sent[0].timings.decode_worker
        ray.kill(served.app.pool.workers[victim].actor, no_restart=False)
        rest = list(stream)
    assert [t for chunk in [*sent, *rest] for t in chunk.token_ids] == expected
    assert rest[-1].timings.decode_worker != victim
