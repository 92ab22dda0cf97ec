"""The official `openai` SDK's completions against the served system (tests/openai/sdk/
conftest.py): the same tokens as gRPC, streams that reassemble to whole responses, choices,
logprobs and stop rules."""

from __future__ import annotations

import pytest

from tests.openai.served import LOW, greedy


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
