"""vLLM's min_tokens: EOS, stop_token_ids and stop strings end a request only after its first
min_tokens tokens; before, a stop token is output like any other and stop strings are not
matched."""

from __future__ import annotations

import pytest

from pdserve.core.sampling_params import SamplingParams
from tests.engine.decoding.test_sampling import PROMPTS, run


def test_a_stop_token_cannot_be_drawn_before_min_tokens(make_engine):
    """Masked, as vLLM does: before min_tokens the stop token is never drawn (greedy takes the
    next best), after it the first one drawn ends the output. EOS: test_min_tokens_mask.py."""
    engine = make_engine()
    free = run(engine, {"a": (PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))})["a"]
    stop_at = free[0][1]  # the second token
    params = SamplingParams(max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True)
    tokens, _, reason, _ = run(engine, {"b": (PROMPTS[2], params)})["b"]
    assert tokens == free[0][:2] and reason == "stop"
    params = SamplingParams(max_tokens=12, min_tokens=4, stop_token_ids=[stop_at], ignore_eos=True)
    tokens, _, reason, _ = run(engine, {"c": (PROMPTS[2], params)})["c"]
    assert tokens[0] == free[0][0] and tokens[1] != stop_at
    assert stop_at not in tokens[:4]
    later = [i for i, t in enumerate(tokens) if t == stop_at]
    assert (len(tokens), reason) == ((later[0] + 1, "stop") if later else (12, "length"))


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
