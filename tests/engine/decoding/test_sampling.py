"""Per-request sampling: seeds, top-k/top-p, stops, max_tokens, logprobs, streamed text."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding.sampler import Sampler
from tests.engine.conftest import random_prompts

PROMPTS = random_prompts([5, 12, 30], seed=2)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Adds the requests, steps to the end; returns {id: (tokens, text, reason, logprobs)}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    result = {rid: ([], "", None, []) for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, text, _, logprobs = result[out.request_id]
            result[out.request_id] = (
                tokens + out.new_token_ids,
                text + out.text_delta,
                out.finish_reason,
                logprobs + (out.new_logprobs or []),
            )
    return result


def test_seeded_sampling_ignores_the_rest_of_the_batch(make_engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = run(make_engine(), {"x": (PROMPTS[1], params)})["x"][0]
    others = {
        f"o{i}": (p, SamplingParams(max_tokens=20, temperature=0.7)) for i, p in enumerate(PROMPTS)
    }
    crowded = run(make_engine(), {**others, "x": (PROMPTS[1], params)})["x"][0]
    assert alone == crowded
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert run(make_engine(), {"x": (PROMPTS[1], other_seed)})["x"][0] != alone


def test_top_k_1_and_tiny_top_p_are_greedy(make_engine):
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    top_k = SamplingParams(max_tokens=8, temperature=5.0, top_k=1, ignore_eos=True)
    top_p = SamplingParams(max_tokens=8, temperature=5.0, top_p=1e-6, ignore_eos=True)
    got = run(
        make_engine(),
        {"g": (PROMPTS[0], greedy), "k": (PROMPTS[0], top_k), "p": (PROMPTS[0], top_p)},
    )
    assert got["g"][0] == got["k"][0] == got["p"][0]


def test_sampler_top_k_only_draws_from_the_k_best():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0]]).repeat(200, 1)
    params = [SamplingParams(temperature=2.0, top_k=2)] * 200
    tokens, _ = Sampler(seed=0)(logits, params, [0] * 200)
    assert set(tokens) == {1, 2}


@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 1e-45])
def test_tiny_temperatures_are_greedy(temperature):
    """logits / temperature would overflow to inf; the sampler must still pick the argmax."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 3
    logits[:4] -= 20  # all-negative rows: every logit / temperature would be -inf
    params = [SamplingParams(temperature=temperature, top_p=0.9, seed=s) for s in range(8)]
    tokens, _ = Sampler(seed=0)(logits, params, [0] * 8)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_stop_token_ids_and_max_tokens(make_engine):
    engine = make_engine()
    free = run(engine, {"a": (PROMPTS[2], SamplingParams(max_tokens=10, ignore_eos=True))})["a"]
    assert len(free[0]) == 10 and free[2] == "length"
    stop_at = free[0][4]
    first = free[0].index(stop_at)
    params = SamplingParams(max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True)
    tokens, _, reason, _ = run(engine, {"b": (PROMPTS[2], params)})["b"]
    assert tokens == free[0][: first + 1] and reason == "stop"


def test_stop_string_ends_generation_and_is_not_emitted(make_engine):
    engine = make_engine()
    tokens, text, _, _ = run(
        engine, {"a": (PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True))}
    )["a"]
    assert text == engine.tokenizer.decode(tokens)  # streamed deltas add up to the full text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "pick another prompt: the stop string should be visible text"
    got_tokens, got_text, reason, _ = run(
        engine, {"b": (PROMPTS[1], SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True))}
    )["b"]
    assert reason == "stop"
    assert got_text == text[: text.index(stop)]
    assert got_tokens == tokens[: len(got_tokens)]


def test_an_engine_without_text_still_stops_on_stop_strings(make_engine, tiny_dir):
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig

    with_text = make_engine()
    tokens, text, _, _ = run(
        with_text, {"a": (PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True))}
    )["a"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True)
    expected, _, _, _ = run(with_text, {"b": (PROMPTS[1], params)})["b"]
    # What workers run: the router makes the client's text, the engine only finds stops.
    without = LLMEngine(
        EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=128), emit_text=False
    )
    plain = run(without, {"c": (PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True))})
    assert plain["c"][:3] == (tokens, "", "length")
    got_tokens, _, reason, _ = run(without, {"d": (PROMPTS[1], params)})["d"]
    assert (got_tokens, reason) == (expected, "stop")


def test_eos_stops_unless_ignored(make_engine):
    engine = make_engine()
    eos = engine.tokenizer.eos_token_ids[0]
    # Force EOS: make it the argmax for every input.
    with torch.no_grad():
        engine.model.lm_head.weight[eos] = engine.model.lm_head.weight.sum(0) * 0 + 50.0
    tokens, _, reason, _ = run(engine, {"a": (PROMPTS[0], SamplingParams(max_tokens=5))})["a"]
    assert tokens == [eos] and reason == "stop"
    tokens, _, reason, _ = run(
        engine, {"b": (PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True))}
    )["b"]
    assert len(tokens) == 5 and reason == "length"


def test_logprobs_of_chosen_tokens_match_transformers(make_engine, hf_tiny):
    engine = make_engine()
    prompt = PROMPTS[1]
    tokens, _, _, logprobs = run(
        engine, {"a": (prompt, SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True))}
    )["a"]
    assert len(logprobs) == 6
    with torch.inference_mode():
        ref = torch.log_softmax(hf_tiny(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert math.isclose(lp, ref[len(prompt) - 1 + i, token].item(), abs_tol=1e-4)


@pytest.mark.parametrize(
    "bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2)]
)
def test_invalid_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_invalid_requests_are_rejected(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("a", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", [5] * (engine.max_model_len + 1), SamplingParams())
    engine.add_request("a", [5], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [5], SamplingParams())
