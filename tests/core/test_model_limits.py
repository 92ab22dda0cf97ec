"""The router and the engine agree on max_model_len: one computation, from config.json and
the EngineConfig, so every request the router admits fits the engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.core import model_limits
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import make_model
from pdserve.pb import generate_pb2
from pdserve.startup_checks import StartupError, load_model_limits
from router.validation import RequestError, validate

WINDOW = 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """The tiny model declared as a Mistral with a 64-token sliding window."""
    directory = make_model(tmp_path_factory.mktemp("mistral"), "tiny", seed=0)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW)
    config_path.write_text(json.dumps(config))
    return directory


# tiny: 2 layers x 2 KV heads x head_dim 16, 2048 positions.
@pytest.mark.parametrize(
    "model, settings, expected",
    [
        ("tiny", {}, 2048),
        ("tiny", {"max_model_len": 100}, 100),
        ("tiny", {"num_kv_blocks": 8, "block_size": 4}, 32),
        # 2 layers * 2 (K, V) * 16 tokens * 2 heads * 16 dims * 4 bytes = 8 KiB per block
        ("tiny", {"kv_cache_bytes": 5 * 8192}, 80),
        ("mistral", {}, WINDOW),
        ("mistral", {"max_model_len": 40}, 40),
    ],
)
def test_router_and_engine_compute_the_same_max_model_len(
    model, settings, expected, tiny_dir, mistral_dir
):
    directory = tiny_dir if model == "tiny" else mistral_dir
    config = EngineConfig(model=str(directory), **settings)
    _, limits = load_model_limits(directory, config)
    engine = LLMEngine(config)
    assert limits.max_model_len == engine.max_model_len == expected


@pytest.mark.parametrize(
    "overrides, window",
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, 64),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None),
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}, None),
        (
            {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
             "use_sliding_window": True, "max_window_layers": 1},
            64,
        ),
        (
            {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
             "use_sliding_window": True, "max_window_layers": 2},
            None,
        ),
    ],
)  # fmt: skip
def test_the_sliding_window_counts_only_where_a_layer_slides(overrides, window):
    config = {"num_hidden_layers": 2, **overrides}
    assert model_limits.sliding_window(config) == window


def request(prompt_len: int, max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5] * prompt_len),
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def no_text(text: str) -> list[int]:
    raise AssertionError("token-id prompts are never tokenized")


@pytest.mark.parametrize(
    "prompt_len, max_tokens, field",
    [(40, 40, "sampling.max_tokens"), (100, 1, "prompt"), (WINDOW, 1, "prompt")],
)
def test_requests_past_the_sliding_window_are_invalid_arguments(
    prompt_len, max_tokens, field, mistral_dir
):
    _, limits = load_model_limits(mistral_dir, EngineConfig(model=str(mistral_dir)))
    with pytest.raises(RequestError, match=f"^{field}: "):
        asyncio.run(validate(request(prompt_len, max_tokens), limits, no_text))
    fits = asyncio.run(validate(request(WINDOW - 8, 8), limits, no_text))
    assert len(fits.prompt_ids) + fits.sampling.max_tokens == WINDOW


def test_a_prompt_that_can_never_fit_the_kv_pool_is_invalid(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), num_kv_blocks=8, block_size=4)
    _, limits = load_model_limits(tiny_dir, config)
    with pytest.raises(RequestError, match="^prompt: 40 tokens do not fit the context of 32"):
        asyncio.run(validate(request(40, 1), limits, no_text))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_model_len": 4096}, "max_model_len 4096 > the model's 2048"),
        ({"kv_cache_bytes": 100}, "the KV cache must hold at least one block"),
    ],
)
def test_settings_that_cannot_serve_fail_before_start(settings, message, tiny_dir):
    with pytest.raises(StartupError, match=message):
        load_model_limits(tiny_dir, EngineConfig(model=str(tiny_dir), **settings))


def test_a_missing_model_directory_is_named(tmp_path):
    with pytest.raises(StartupError, match=r"^--model: directory .*/absent does not exist$"):
        load_model_limits(tmp_path / "absent", EngineConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(StartupError, match=r"^--model .*/empty: .*config\.json"):
        load_model_limits(tmp_path / "empty", EngineConfig())
