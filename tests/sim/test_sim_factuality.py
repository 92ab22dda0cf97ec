"""DoLa and SLED on sim workers: accepted and checked like on torch workers, but the tokens stay
the sim's deterministic function of the context (docs/simulation.md, "Tokens")."""

from __future__ import annotations

import pytest

from pdserve.core.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]


def test_rules_leave_sim_tokens_unchanged(make_sim_engine):
    engine = make_sim_engine()
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = engine.generate(PROMPTS, plain)
    for rule in (dict(dola_layers="high"), dict(sled=True, sled_layers=[0, 8, 16, 24])):
        params = SamplingParams(max_tokens=6, ignore_eos=True, **rule)
        assert engine.generate(PROMPTS, params) == expected


def test_sim_refuses_layers_its_model_lacks(make_sim_engine):
    engine = make_sim_engine()
    with pytest.raises(ValueError, match="^dola_layers: layer 32 "):
        engine.add_request("r", PROMPTS[0], SamplingParams(dola_layers=[4, 32]))
