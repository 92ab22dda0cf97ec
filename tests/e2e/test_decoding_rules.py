"""n choices and beam search over a served system (real Ray workers, gRPC and the OpenAI HTTP
API), colocated and disaggregated over each KV transport: the prompt is prefilled once, the
decode worker forks the choices, the router reassembles them by index, and seeded choice i
equals a single request with seed + i."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from pdserve.client import GenerationClient, GenerationError

PROMPT = [5, 17, 99, 23, 42, 7, 61, 88, 130]  # 2 full blocks of 4 + a partial one
SAMPLED = {"max_tokens": 8, "temperature": 1.0, "seed": 1234, "ignore_eos": True}


# Disaggregated over every KV transport (the decode worker forks after the handoff), and
# colocated.
LAYOUTS = [("grpc", "always"), ("collective", "always"), ("nixl", "always"), ("grpc", "never")]


@pytest.fixture(
    scope="module",
    params=LAYOUTS,
    ids=["disaggregated-grpc", "disaggregated-collective", "disaggregated-nixl", "colocated"],
)
def served(request, ray_cluster):
    from pdserve.app import BackgroundApp
    from tests.e2e.conftest import serve_config

    transport, disaggregate = request.param
    config = serve_config(transport, prefill_workers=1, decode_workers=1)
    config.router.disaggregate = disaggregate
    with BackgroundApp(config) as app:
        yield app


@pytest.fixture(scope="module")
def client(served):
    with GenerationClient(f"127.0.0.1:{served.port}") as client:
        yield client


def used_blocks(served) -> int:
    import ray

    workers = served.app.pool.workers.values()
    return sum(ray.get(w.actor.stats.remote()).num_used_blocks for w in workers)


def wait_idle(served, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (used := used_blocks(served)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


def test_seeded_choices_equal_single_requests_with_their_seeds(served, client):
    completion = client.generate(PROMPT, n=3, logprobs=True, **SAMPLED)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        alone = client.generate(PROMPT, **{**SAMPLED, "seed": SAMPLED["seed"] + choice.index})
        assert choice.token_ids == alone.token_ids, choice.index
        assert choice.finish_reason == "length"
        assert choice.cumulative_logprob == pytest.approx(sum(choice.logprobs), abs=1e-4)
    assert len({tuple(c.token_ids) for c in completion.choices}) == 3
    assert completion.usage.prompt_tokens == len(PROMPT)  # counted once
    assert completion.usage.completion_tokens == 3 * SAMPLED["max_tokens"]
    assert completion.timings.disaggregated == (served.app.config.router.disaggregate == "always")
    assert wait_idle(served) == 0


def test_each_choice_finishes_on_its_own(served, client):
    reference = [
        client.generate(PROMPT, **{**SAMPLED, "seed": SAMPLED["seed"] + i}).token_ids
        for i in range(2)
    ]
    stop = reference[1][3]
    completion = client.generate(PROMPT, n=2, stop_token_ids=[stop], **SAMPLED)
    for choice, tokens in zip(completion.choices, reference, strict=True):
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert choice.token_ids == tokens[:cut]
        assert choice.finish_reason == ("stop" if stop in tokens else "length")
    assert wait_idle(served) == 0


def test_http_n_choices_match_grpc(served, client):
    body = {"model": client.model_info().name, "prompt": PROMPT, "n": 2}
    body.update(SAMPLED, return_token_ids=True)
    response = httpx.post(f"http://127.0.0.1:{served.http_port}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert [c["index"] for c in result["choices"]] == [0, 1]
    for choice in result["choices"]:
        alone = client.generate(PROMPT, **{**SAMPLED, "seed": SAMPLED["seed"] + choice["index"]})
        assert choice["token_ids"] == alone.token_ids
    assert result["usage"]["prompt_tokens"] == len(PROMPT)
    assert result["usage"]["completion_tokens"] == 2 * SAMPLED["max_tokens"]


def test_bad_n_is_invalid_argument_naming_the_field(client):
    with pytest.raises(GenerationError) as error:
        client.generate(PROMPT, n=0)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details.startswith("sampling.n:")


BEAM_PROMPTS = [[5, 17, 99, 23, 42, 7, 61, 88, 130, 9 + i] for i in range(4)] + [
    [200 + i, 31, 77, 12, 150, 64, 3 + i] for i in range(4)
]


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    import torch

    from pdserve.models.builtin import default_model_dir

    model_dir = default_model_dir()
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_beam_search_equals_transformers_over_the_served_system(served, client, hf_model):
    """8 prompts, each sent twice (the second finds its prefix cached): the returned beams
    and scores are transformers' generate(num_beams=3, num_return_sequences=2)."""
    import torch

    for prompt in BEAM_PROMPTS:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                num_beams=3,
                num_return_sequences=2,
                do_sample=False,
                length_penalty=0.8,
                eos_token_id=[1],
                pad_token_id=0,
                return_dict_in_generate=True,
                output_scores=True,
            )
        lengths = (ref.beam_indices >= 0).sum(dim=1).tolist()
        tokens = [ref.sequences[i, len(prompt) : len(prompt) + lengths[i]].tolist() for i in (0, 1)]
        for attempt in range(2):
            completion = client.generate(
                prompt, max_tokens=6, beam_width=3, n=2, length_penalty=0.8
            )
            assert [c.token_ids for c in completion.choices] == tokens, (prompt, attempt)
            scores = [c.score for c in completion.choices]
            assert scores == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
            assert completion.usage.completion_tokens == sum(map(len, tokens))
        assert completion.usage.cached_prompt_tokens > 0  # the second time
    assert wait_idle(served) == 0
