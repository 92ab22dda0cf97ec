"""vLLM's min_tokens: EOS, stop_token_ids and stop strings end a request only after its first
min_tokens tokens; before, a stop token is output like any other and stop strings are not
matched."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from tests.engine.decoding.test_sampling import PROMPTS, run


def test_a_stop_token_ends_the_output_only_after_min_tokens(make_engine):
    engine = make_engine()
    free = run(engine, {"a": (PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))})["a"]
    stop_at = free[0][1]  # the second token
    later = [i for i, t in enumerate(free[0]) if t == stop_at and i >= 4]
    params = SamplingParams(max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True)
    tokens, _, reason, _ = run(engine, {"b": (PROMPTS[2], params)})["b"]
    assert tokens == free[0][:2] and reason == "stop"
    params = SamplingParams(max_tokens=12, min_tokens=4, stop_token_ids=[stop_at], ignore_eos=True)
    tokens, _, reason, _ = run(engine, {"c": (PROMPTS[2], params)})["c"]
    end = later[0] + 1 if later else 12
    assert tokens == free[0][:end] and reason == ("stop" if later else "length")


def test_eos_is_output_until_min_tokens(make_engine):
    engine = make_engine()
    eos = engine.tokenizer.eos_token_ids[0]
    with torch.no_grad():  # EOS the argmax for every input
        engine.model.lm_head.weight[eos] = engine.model.lm_head.weight.sum(0) * 0 + 50.0
    assert run(engine, {"a": (PROMPTS[0], SamplingParams(max_tokens=8))})["a"][0] == [eos]
    params = SamplingParams(max_tokens=8, min_tokens=3)
    tokens, _, reason, _ = run(engine, {"b": (PROMPTS[0], params)})["b"]
    assert tokens[0] == eos and len(tokens) > 3  # the first EOS was output, not an ending
    # The first EOS after the first three tokens ends it, or max_tokens does.
    after = [i for i, t in enumerate(tokens) if t == eos and i >= 3]
    assert (len(tokens), reason) == ((after[0] + 1, "stop") if after else (8, "length"))


def test_a_stop_string_is_matched_only_after_min_tokens(make_engine):
    engine = make_engine()
    tokens, text, _, _ = run(
        engine, {"a": (PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True))}
    )["a"]
    stop = text[:2]  # in the first token's text: ends a plain request at once
    assert stop.strip(), "pick another prompt: the stop string should be visible text"
    plain = SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True)
    assert run(engine, {"b": (PROMPTS[1], plain)})["b"][2] == "stop"
    held = SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True, min_tokens=24)
    got_tokens, got_text, reason, _ = run(engine, {"c": (PROMPTS[1], held)})["c"]
    assert (got_tokens, got_text, reason) == (tokens, text, "length")


@pytest.mark.parametrize(
    ("params", "words"),
    [
        (dict(max_tokens=4, min_tokens=5), "min_tokens: must be in [0, max_tokens = 4]"),
        (dict(min_tokens=-1), "min_tokens: must be in"),
        (dict(min_tokens=2, beam_width=2), "min_tokens: not supported with beam search"),
    ],
)
def test_bad_min_tokens_are_refused_by_name(params, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        SamplingParams(**params)
