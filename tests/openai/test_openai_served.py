"""The official `openai` SDK against a served system (real Ray workers, the router's HTTP API):
the same tokens as gRPC, streams that reassemble to whole responses, errors by status, and a
client that disconnects aborting its request on the workers."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client import REGISTRY

from pdserve.client import GenerationClient
from pdserve.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate

KEY = "sk-openai-test"
LOW = 5  # token ids from here on are ordinary byte/merge tokens of the tiny model


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    from pdserve.app import BackgroundApp
    from pdserve.models.builtin import BUILTIN_VERSION, make_model
    from tests.e2e.conftest import serve_config

    # Named as the built-in model's directory, which `bench serve` knows the vocabulary of.
    model_dir = make_model(tmp_path_factory.mktemp("model") / f"tiny-llama-v{BUILTIN_VERSION}")
    config = serve_config("grpc", prefill_workers=1, decode_workers=1)
    config.engine.model = str(model_dir)
    config.router.api_keys = [KEY]
    with BackgroundApp(config) as app:
        app.model_dir = model_dir
        yield app


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key=KEY, max_retries=0
    )


@pytest.fixture(scope="module")
def grpc_client(served):
    with GenerationClient(f"127.0.0.1:{served.port}", api_key=KEY) as client:
        yield client


@pytest.fixture(scope="module")
def model(served) -> str:
    return served.model_dir.name


def greedy(**extra) -> dict:
    return {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True, **extra}}


def used_blocks(served) -> dict[str, int]:
    import ray

    workers = served.app.pool.workers.values()
    return {w.worker_id: ray.get(w.actor.stats.remote()).num_used_blocks for w in workers}


def wait_idle(served, timeout_s: float = 15.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while any((used := used_blocks(served)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


def cancelled_requests() -> float:
    return REGISTRY.get_sample_value("pdserve_requests_total", {"outcome": "cancelled"}) or 0.0


def test_completions_give_the_grpc_tokens_for_token_and_text_prompts(client, grpc_client, model):
    for prompt in (list(range(LOW + 20, LOW + 45)), "The quick brown fox jumps over"):
        response = client.completions.create(model=model, prompt=prompt, max_tokens=12, **greedy())
        expected = grpc_client.generate(prompt, max_tokens=12, ignore_eos=True)
        choice = response.choices[0]
        assert choice.token_ids == expected.token_ids
        assert choice.text == expected.text
        assert choice.finish_reason == "length"
        assert response.usage.prompt_tokens == expected.usage.prompt_tokens
        assert response.usage.completion_tokens == 12
        assert response.usage.total_tokens == response.usage.prompt_tokens + 12
        assert response.object == "text_completion" and response.model == model


def test_a_repeated_prompt_reports_cached_tokens(client, model):
    prompt = list(range(LOW + 100, LOW + 140))
    for _ in range(2):
        response = client.completions.create(model=model, prompt=prompt, max_tokens=2, **greedy())
    assert response.usage.prompt_tokens_details.cached_tokens >= 32


def test_a_streamed_completion_reassembles_to_the_whole_one(client, model):
    prompt = list(range(LOW + 50, LOW + 70))
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=16, **greedy())
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(),
        )
    )
    *content, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 16
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [t for c in content for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert all(c.usage is None for c in content)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, model):
    chunks = list(
        client.completions.create(
            model=model,
            prompt=list(range(LOW + 150, LOW + 170)),
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **greedy(),
        )
    )
    *content, last = chunks
    tokens = 0
    for chunk in content:
        tokens += len(chunk.choices[0].token_ids)
        assert chunk.usage.completion_tokens == tokens
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + tokens == 20 + tokens
    assert tokens == 8 and last.choices == [] and last.usage.completion_tokens == 8


def test_several_prompts_are_choices_by_index(client, model):
    prompts = [list(range(LOW + 200, LOW + 210)), list(range(LOW + 300, LOW + 318))]
    whole = client.completions.create(model=model, prompt=prompts, max_tokens=6, **greedy())
    singles = [
        client.completions.create(model=model, prompt=p, max_tokens=6, **greedy()).choices[0]
        for p in prompts
    ]
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.token_ids for c in whole.choices] == [c.token_ids for c in singles]
    assert whole.usage.completion_tokens == 12
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in client.completions.create(
        model=model, prompt=prompts, max_tokens=6, stream=True, **greedy()
    ):
        streamed[chunk.choices[0].index] += chunk.choices[0].token_ids
    assert [streamed[0], streamed[1]] == [c.token_ids for c in singles]


def test_n_choices_with_the_sdk_equal_single_requests_with_their_seeds(client, model):
    """n > 1 through the official SDK, whole and streamed: choice i of a seeded request is the
    single request seeded with seed + i, and the prompt counts once in the usage."""
    prompt = list(range(LOW + 400, LOW + 413))
    sampled = {
        "max_tokens": 6,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    whole = client.completions.create(model=model, prompt=prompt, n=3, seed=77, **sampled)
    singles = [
        client.completions.create(model=model, prompt=prompt, seed=77 + i, **sampled).choices[0]
        for i in range(3)
    ]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.token_ids for c in whole.choices] == [c.token_ids for c in singles]
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == 18
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(
        model=model, prompt=prompt, n=3, seed=77, stream=True, **sampled
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.token_ids or []
    assert [streamed[i] for i in range(3)] == [c.token_ids for c in singles]


def test_logprobs_are_the_grpc_ones(client, grpc_client, model):
    prompt = list(range(LOW + 60, LOW + 80))
    expected = grpc_client.generate(prompt, max_tokens=5, ignore_eos=True, logprobs=True)
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=5, logprobs=0, **greedy()
    )
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-6)
    assert len(logprobs.tokens) == len(logprobs.text_offset) == 5
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=5,
        logprobs=True,
        **greedy(),
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 5 and all(e.logprob <= 0 and e.top_logprobs == [] for e in entries)


def test_chat_renders_the_template_and_gives_the_grpc_tokens(served, client, grpc_client, model):
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
        },
    ]
    response = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=10, **greedy()
    )
    rendered = ChatTemplate.from_dir(served.model_dir).render(
        [messages[0], {"role": "user", "content": "Hello\nthere"}]
    )
    prompt_ids = Tokenizer.from_dir(served.model_dir).encode(rendered, add_special_tokens=False)
    expected = grpc_client.generate(prompt_ids, max_tokens=10, ignore_eos=True)
    choice = response.choices[0]
    assert choice.prompt_token_ids == prompt_ids
    assert choice.token_ids == expected.token_ids
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert response.object == "chat.completion" and response.usage.completion_tokens == 10


def test_async_chat_streams_reassemble_to_whole_responses(served, model):
    async def main() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key=KEY, max_retries=0
        )
        questions = [f"question number {i}?" for i in range(4)]

        async def both(question: str) -> tuple[str, str, str | None]:
            messages = [{"role": "user", "content": question}]
            whole = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, **greedy()
            )
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, stream=True, **greedy()
            )
            chunks = [chunk async for chunk in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            return whole.choices[0].message.content, text, chunks[-1].choices[0].finish_reason

        results = await asyncio.gather(*(both(q) for q in questions))
        for whole, streamed, finish in results:
            assert streamed == whole and finish == "length"
        await client.close()

    asyncio.run(main())


def test_errors_have_the_documented_statuses(served, client, model):
    with pytest.raises(openai.BadRequestError, match=r"n: must be in \[1, 64\]"):
        client.completions.create(model=model, prompt="x", n=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="x")
    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.completions.create(model=model, prompt="x")
    router = served.app.config.router
    limit, router.max_pending_requests = router.max_pending_requests, 0  # admission refuses all
    try:
        with pytest.raises(openai.RateLimitError, match="overloaded"):
            client.completions.create(model=model, prompt="x", max_tokens=2)
        with pytest.raises(openai.RateLimitError, match="overloaded"):
            client.completions.create(model=model, prompt="x", max_tokens=2, stream=True)
    finally:
        router.max_pending_requests = limit


def test_probes_and_metrics_on_the_http_port(served):
    base = f"http://127.0.0.1:{served.http_port}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready").status_code == 200
    metrics = httpx.get(f"{base}/metrics").text
    assert 'pdserve_requests_total{outcome="length"}' in metrics


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request_on_both_workers(served, model, stream):
    assert wait_idle(served) == dict.fromkeys(served.app.pool.workers, 0)
    cancelled = cancelled_requests()
    body = {
        "model": model,
        "prompt": list(range(LOW + 400, LOW + 440)),
        "max_tokens": 2000,  # with the prompt, the model's whole context: seconds of decoding
        "ignore_eos": True,
        "stream": stream,
    }
    url = f"http://127.0.0.1:{served.http_port}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    started = time.monotonic()
    if stream:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            assert response.status_code == 200
            first = next(response.iter_lines())
            assert first.startswith("data: {")
        # Leaving the block closed the connection mid-stream.
    else:
        with pytest.raises(httpx.ReadTimeout):  # gives up long before the last token
            httpx.post(url, json=body, headers=headers, timeout=1)
    assert wait_idle(served) == dict.fromkeys(served.app.pool.workers, 0)
    deadline = time.monotonic() + 5
    while cancelled_requests() < cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled_requests() == cancelled + 1
    assert time.monotonic() - started < 20


def test_the_clients_traceparent_reaches_both_workers(served, client, model):
    import ray

    trace_id = "5cf92f3577b34da6a3ce929d0e0e4736"
    response = client.completions.create(
        model=model,
        prompt=list(range(LOW + 30, LOW + 42)),
        max_tokens=3,
        extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        **greedy(),
    )
    work_id = response.id.removeprefix("cmpl-")
    (decode,) = served.app.pool.of_role("decode")
    seen = ray.get(decode.actor.trace_contexts.remote())[work_id]
    # Through the router's Ray call and through the prefill worker's KV chunks and commit.
    assert seen["ray"]["traceparent"].split("-")[1] == trace_id
    assert seen["kv"]["traceparent"].split("-")[1] == trace_id


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_vllm_named_metrics_count_the_request_under_the_model(served, client, model):
    before = {
        "prompt": sample("vllm:prompt_tokens_total", model_name=model),
        "generation": sample("vllm:generation_tokens_total", model_name=model),
        "length": sample("vllm:request_success_total", model_name=model, finished_reason="length"),
        "ttft": sample("vllm:time_to_first_token_seconds_count", model_name=model),
    }
    response = client.completions.create(
        model=model, prompt=list(range(LOW + 330, LOW + 347)), max_tokens=7, **greedy()
    )
    assert response.usage.prompt_tokens == 17
    assert sample("vllm:prompt_tokens_total", model_name=model) == before["prompt"] + 17
    assert sample("vllm:generation_tokens_total", model_name=model) == before["generation"] + 7
    assert (
        sample("vllm:request_success_total", model_name=model, finished_reason="length")
        == before["length"] + 1
    )
    assert sample("vllm:time_to_first_token_seconds_count", model_name=model) == before["ttft"] + 1
    scraped = httpx.get(f"http://127.0.0.1:{served.http_port}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert f'{name}{{model_name="{model}"}}' in scraped


def test_one_token_per_event_streams_each_token_alone(client, model):
    prompt = list(range(LOW + 60, LOW + 80))
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=24, **greedy())
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=24,
            stream=True,
            stream_options={"one_token_per_event": True},
            **greedy(),
        )
    )
    assert [c.choices[0].token_ids for c in chunks] == [[t] for t in whole.choices[0].token_ids]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_min_tokens_masks_the_stop_tokens_until_then(client, model):
    prompt = list(range(LOW + 90, LOW + 110))
    free = client.completions.create(model=model, prompt=prompt, max_tokens=10, **greedy())
    first = free.choices[0].token_ids[0]
    stopped = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, **greedy(stop_token_ids=[first])
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    held = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, **greedy(stop_token_ids=[first], min_tokens=3)
    )
    tokens = held.choices[0].token_ids
    # The stop token is never chosen before 3 tokens (another greedy path), then ends it.
    assert first not in tokens[:3] and tokens[0] != first
    later = [i for i, t in enumerate(tokens) if t == first]
    assert later in ([], [len(tokens) - 1])
    assert held.choices[0].finish_reason == ("stop" if later else "length")
    assert len(tokens) == (later[0] + 1 if later else 10)


def test_vllm_tpot_and_itl_histograms_count_the_request_under_the_model(client, model):
    names = (
        "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    )

    def histograms() -> dict[str, tuple[float, float]]:
        return {
            n: (sample(f"{n}_count", model_name=model), sample(f"{n}_sum", model_name=model))
            for n in names
        }

    before = histograms()
    list(
        client.completions.create(
            model=model,
            prompt=list(range(LOW + 360, LOW + 377)),
            max_tokens=7,
            stream=True,
            stream_options={"one_token_per_event": True},
            **greedy(),
        )
    )
    after = histograms()
    count = {n: after[n][0] - before[n][0] for n in names}
    total = {n: after[n][1] - before[n][1] for n in names}
    tpot, itl, ttft, e2e = names
    assert count[tpot] == 1 and count[itl] == 6  # one per request; one per token after the first
    assert total[tpot] == pytest.approx((total[e2e] - total[ttft]) / 6, rel=1e-6)
    assert total[itl] == pytest.approx(total[e2e] - total[ttft], rel=1e-6)


@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_bench_serve_drives_either_api_with_the_same_workload(served, backend, tmp_path):
    import argparse
    import json

    from pdserve.bench.serving import serve_bench

    out = tmp_path / "run.json"
    argv = ["--backend", backend, "--api-key", KEY, "--no-progress", "--json", str(out)]
    argv += ["--dataset", "random", "--num-requests", "6", "--max-concurrency", "3"]
    argv += ["--random-input-len", "16", "--random-output-len", "8", "--seed", "3"]
    if backend == "openai":
        argv += ["--base-url", f"http://127.0.0.1:{served.http_port}/v1"]  # vocabulary: the card's
    else:
        argv += ["--target", f"127.0.0.1:{served.port}"]
    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    assert serve_bench.run(parser.parse_args(argv)) == 0
    document = json.loads(out.read_text())
    assert (document["summary"]["completed"], document["summary"]["failed"]) == (6, 0)
    assert document["summary"]["total_output_tokens"] == 6 * 8
    assert all(len(r["chunk_times"]) >= 1 for r in document["requests"])
    assert document["config"]["model"] == served.model_dir.name


def test_the_api_bench_drives_both_apis_at_once_to_the_end(served, model):
    """`pdserve bench api --together`: both clients on one event loop, each its own requests
    and arrival schedule, overlapping in time, every token of every stream received."""
    from pdserve.bench.serving.api_bench import APIS, run_clients_together
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    dataset = DatasetConfig(name="random", random_input_len=24, random_output_len=6)
    requests = generate_requests(dataset, 8, 3, 260, avoid_token_ids=range(LOW))
    addresses = {
        "grpc": f"127.0.0.1:{served.port}",
        "http": f"http://127.0.0.1:{served.http_port}/v1",
    }
    loads = {
        api: {"max_concurrency": 2, "seed": seed, "request_rate": 40.0, "api_key": KEY}
        for seed, api in enumerate(APIS)
    }
    got = run_clients_together(
        addresses, model, {"grpc": requests[:4], "http": requests[4:]}, loads
    )
    assert sorted(got) == sorted(APIS)
    for records in got.values():
        assert [r.ok for r in records] == [True] * 4, [r.error for r in records]
        assert [r.output_tokens for r in records] == [6] * 4
    spans = {
        api: (min(r.send_time for r in rs), max(r.end_time for r in rs)) for api, rs in got.items()
    }
    (grpc_start, grpc_end), (http_start, http_end) = spans["grpc"], spans["http"]
    assert grpc_start < http_end and http_start < grpc_end  # the two loads overlapped
