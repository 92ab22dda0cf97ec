"""Speculative decoding over a served system (real Ray workers, gRPC, Redis): with
`--speculative ngram` (and draft), colocated and disaggregated over each KV transport, greedy
outputs equal a non-speculative engine's token for token, with prefix-cache hits and after a
retried KV transfer; only the decode pool speculates; a request that opts out is not speculated
(the workers' counters prove it); the counters reach the router's Prometheus endpoint and each
request's decode span."""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pdserve import telemetry
from pdserve.bench.serving.span_receiver import SpanReceiver
from pdserve.client import GenerationClient
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine_config import SpeculativeConfig
from pdserve.prefix_index.spec_stats import read_speculation_stats
from tests.e2e.conftest import ENGINE, serve_config

# A periodic prompt: prompt lookup (ngram) finds where its suffix occurred and proposes what
# followed, and the tiny model's greedy continuation often repeats it.
PERIODIC = [5, 17, 99, 23, 42, 7] * 4
PROMPTS = [PERIODIC, PERIODIC[:10] + [61, 88, 130] * 3, [200 + i for i in range(13)]]
GREEDY = {"max_tokens": 24, "ignore_eos": True}
SPEC_FIELDS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")

# (method, KV transport, router.disaggregate): disaggregated over every transport, colocated
# (the decode worker prefills), and the draft model disaggregated (the decode worker computes
# the draft's prompt KV itself).
LAYOUTS = [
    ("ngram", "grpc", "always"),
    ("ngram", "collective", "always"),
    ("ngram", "nixl", "always"),
    ("ngram", "grpc", "never"),
    ("draft", "grpc", "always"),
]
LAYOUT_IDS = ["ngram-grpc", "ngram-collective", "ngram-nixl", "ngram-colocated", "draft-grpc"]


@pytest.fixture(scope="module")
def model_dir():
    from pdserve.models.builtin import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    from pdserve.models.draft_of import write_draft_of

    return write_draft_of(model_dir, tmp_path_factory.mktemp("draft"))[0]


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy outputs of a non-speculative engine on the served model, by prompt."""
    from pdserve.engine.engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(ENGINE, model=str(model_dir)))
    outputs = engine.generate(PROMPTS, SamplingParams(**GREEDY))
    return {tuple(p): out for p, out in zip(PROMPTS, outputs, strict=True)}


@pytest.fixture(scope="module")
def receiver():
    receiver = SpanReceiver()
    endpoint = receiver.start()
    yield receiver, endpoint
    receiver.stop()


@pytest.fixture(scope="module", params=LAYOUTS, ids=LAYOUT_IDS)
def served(request, ray_cluster, receiver, draft_dir):
    from pdserve.app import BackgroundApp

    method, transport, disaggregate = request.param
    _, endpoint = receiver
    # Read by this process's router and forwarded to the worker actors.
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    config = serve_config(transport, prefill_workers=1, decode_workers=1, metrics_port=0)
    config.router.disaggregate = disaggregate
    config.worker.fault_injection = True  # the retry test corrupts a KV chunk
    config.engine.speculative = SpeculativeConfig(
        method=method,
        draft_model=str(draft_dir) if method == "draft" else None,
        num_speculative_tokens=4,
        # Never paused: the tiny random model's draft is rarely right, and every request here
        # must speculate for the counters to prove where they went.
        min_acceptance=0.0,
    )
    try:
        with BackgroundApp(config) as app:
            yield app
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        telemetry.setup_tracing("pdserve-router")  # this process exports as before again


@pytest.fixture(scope="module")
def client(served):
    with GenerationClient(f"127.0.0.1:{served.port}") as client:
        yield client


def method_of(served) -> str:
    return served.app.config.engine.speculative.method


def worker_stats(served, role: str) -> list:
    import ray

    workers = served.app.pool.of_role(role)
    return ray.get([w.actor.stats.remote() for w in workers])


def spec_counts(served, role: str = "decode") -> tuple[int, ...]:
    """Draft tokens, accepted tokens and verify steps summed over the workers of `role`."""
    stats = worker_stats(served, role)
    return tuple(sum(getattr(s, name) for s in stats) for name in SPEC_FIELDS)


def wait_idle(served, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        used = sum(
            s.num_used_blocks for r in ("prefill", "decode") for s in worker_stats(served, r)
        )
        if not used or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def test_greedy_outputs_equal_a_non_speculative_engine(served, client, reference):
    before = spec_counts(served)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched together on the decode worker
        completions = list(pool.map(lambda p: client.generate(p, **GREEDY), PROMPTS))
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert completion.token_ids == reference[tuple(prompt)], prompt
        assert completion.finish_reason == "length"
    again = client.generate(PROMPTS[0], **GREEDY)  # its prompt blocks are cached now
    assert again.usage.cached_prompt_tokens > 0
    assert again.token_ids == reference[tuple(PROMPTS[0])]
    drafted, accepted, steps = (a - b for a, b in zip(spec_counts(served), before, strict=True))
    assert drafted > 0 and steps > 0
    assert 0 <= accepted <= drafted
    if method_of(served) == "ngram":
        assert accepted > 0  # the periodic prompts' continuations are found
    assert spec_counts(served, "prefill") == (0, 0, 0)  # prefill workers never speculate
    assert wait_idle(served) == 0


def test_an_opted_out_request_is_not_speculated(served, client, reference, model_dir):
    before = spec_counts(served)
    completion = client.generate(PROMPTS[0], disable_speculation=True, **GREEDY)
    assert completion.token_ids == reference[tuple(PROMPTS[0])]
    # The OpenAI API's extra body field, as vLLM accepts extras.
    body = {"model": model_dir.name, "prompt": PROMPTS[0], "return_token_ids": True, **GREEDY}
    url = f"http://127.0.0.1:{served.http_port}/v1/completions"
    response = httpx.post(url, json={**body, "disable_speculation": True}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == reference[tuple(PROMPTS[0])]
    assert spec_counts(served) == before
    assert wait_idle(served) == 0


def test_a_seeded_sampled_request_is_reproducible(served, client):
    sampled = {**GREEDY, "temperature": 0.8, "top_k": 50, "seed": 7}
    first = client.generate(PROMPTS[0], **sampled)
    assert client.generate(PROMPTS[0], **sampled).token_ids == first.token_ids
    assert len(first.token_ids) == GREEDY["max_tokens"]


def test_the_output_is_exact_after_a_retried_transfer(served, client, reference):
    import ray

    if served.app.config.router.disaggregate == "never":
        pytest.skip("colocated: no KV transfer to fail")
    prefill = served.app.pool.of_role("prefill")
    for worker in prefill:
        ray.get(worker.actor.inject_fault.remote("corrupt_next_chunk"))
    try:
        completion = client.generate(PROMPTS[1], **GREEDY)
    finally:
        for worker in prefill:
            ray.get(worker.actor.inject_fault.remote("none"))
    assert completion.token_ids == reference[tuple(PROMPTS[1])]
    assert sum(s.transfer_failures for s in worker_stats(served, "prefill")) >= 1
    assert wait_idle(served) == 0


def router_views(served, model: str) -> tuple[float, float, int]:
    """decode-0's draft tokens as the router shows them: its Prometheus counter, the served
    model's vLLM counter (one decode worker: the same count) and the Redis count `pdserve
    stats` prints."""
    url = f"http://127.0.0.1:{served.app.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    redis_client = redis.Redis.from_url(served.app.redis_server.url)
    try:
        spec = read_speculation_stats(redis_client, [model]).get(model)
    finally:
        redis_client.close()
    return (
        samples.get(("pdserve_spec_draft_tokens_total", (("worker", "decode-0"),)), 0.0),
        samples.get(("vllm:spec_decode_num_draft_tokens_total", (("model_name", model),)), 0.0),
        spec.workers["decode-0"].draft_tokens if spec and "decode-0" in spec.workers else 0,
    )


def settled_views(served, model: str, worker_draft_tokens: int) -> tuple[float, float, int]:
    """router_views once the router has polled decode-0 at `worker_draft_tokens` and its
    listeners are done (two reads a poll interval apart agree)."""
    deadline = time.monotonic() + 10
    previous = None
    while time.monotonic() < deadline:
        stats = served.app.pool.workers["decode-0"].stats
        if stats is not None and stats.spec_draft_tokens == worker_draft_tokens:
            views = router_views(served, model)
            if views == previous:
                return views
            previous = views
        time.sleep(0.3)
    raise AssertionError(f"the router never settled at {worker_draft_tokens} draft tokens")


def test_counters_reach_the_router_and_the_decode_span(served, receiver, reference, model_dir):
    spans_in, _ = receiver
    before_worker = spec_counts(served)
    before = settled_views(served, model_dir.name, before_worker[0])
    traces = {}
    for opt_out in (False, True):
        trace_id = secrets.token_hex(16)
        traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
        with GenerationClient(
            f"127.0.0.1:{served.port}", metadata={"traceparent": traceparent}
        ) as client:
            completion = client.generate(PROMPTS[0], disable_speculation=opt_out, **GREEDY)
        assert completion.token_ids == reference[tuple(PROMPTS[0])]
        traces[opt_out] = trace_id
    drafted, accepted, _ = (a - b for a, b in zip(spec_counts(served), before_worker, strict=True))
    assert drafted > 0

    # The router polls the workers' stats: each of its counts grows by the worker's exactly.
    after = settled_views(served, model_dir.name, before_worker[0] + drafted)
    assert [a - b for a, b in zip(after, before, strict=True)] == [drafted] * 3

    def decode_span(trace_id: str):
        spans = spans_in.wait_for(
            lambda got: any(s.trace_id == trace_id and s.name == "pdserve.decode" for s in got)
        )
        return next(s for s in spans if s.trace_id == trace_id and s.name == "pdserve.decode")

    speculated, opted_out = decode_span(traces[False]), decode_span(traces[True])
    # The opted-out request added nothing: the speculated one's span holds all of it.
    assert speculated.attributes["pdserve.spec.draft_tokens"] == drafted
    assert speculated.attributes["pdserve.spec.accepted_tokens"] == accepted
    assert opted_out.attributes["pdserve.spec.draft_tokens"] == 0
    assert opted_out.attributes["pdserve.spec.accepted_tokens"] == 0
