"""DoLa, SLED and the repetition penalty through the served system, disaggregated (real Ray
workers, gRPC client): the prefill worker samples the first token under the rule, the decode
worker continues it, and the tokens equal one in-process engine's on the same model (whose
exactness against transformers tests/engine/decoding/test_factuality.py checks)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from pdserve.client import GenerationClient, GenerationError
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine

PROMPTS = [[5, 17, 99, 23, 42, 7, 61, 88, 130], [200, 31, 77, 12, 150, 64, 3]]
RULES = {
    "dola": {"dola_layers": "high", "repetition_penalty": 1.2},
    "dola-list": {"dola_layers": [0, 1]},
    "sled": {"sled": True, "evolution_rate": 1.5, "evolution_scale": 8},
}
COMMON = {"max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(ray_cluster):
    """(the app, a gRPC client of it): one prefill and one decode worker, always disaggregated."""
    from pdserve.app import BackgroundApp
    from tests.e2e.conftest import serve_config

    config = serve_config("grpc", prefill_workers=1, decode_workers=1)
    with BackgroundApp(config) as app, GenerationClient(f"127.0.0.1:{app.port}") as client:
        yield app, client


@pytest.mark.parametrize("rule", sorted(RULES))
def test_served_rule_equals_one_engine(served, rule):
    app, client = served
    engine = LLMEngine(dataclasses.replace(app.app.config.engine))
    params = SamplingParams(**COMMON, **RULES[rule])
    expected = engine.generate(PROMPTS, params)
    plain = engine.generate(PROMPTS, SamplingParams(**COMMON))
    assert expected != plain  # the rule changes the tokens, so the comparison can fail
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        completion = client.generate(prompt, **COMMON, **RULES[rule])
        assert completion.timings.disaggregated
        assert completion.choices[0].token_ids == tokens, prompt


def test_layer_beyond_the_model_is_invalid_argument(served):
    _, client = served
    with pytest.raises(GenerationError) as error:
        client.generate(PROMPTS[0], dola_layers=[0, 7], **COMMON)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "dola_layers" in error.value.details
