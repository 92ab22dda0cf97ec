"""--sim-profile values and the timing models they name: spec-sheet rooflines on a Llama-3.1-8B
shape, fitted linear coefficients, and one-line errors for anything unknown or malformed."""

from __future__ import annotations

import json

import pytest

from pdserve.commands import CommandError
from pdserve.config import ConfigError
from pdserve.engine_config import SimConfig
from pdserve.sim.gpus import GPUS
from pdserve.sim.model_shape import ModelShape
from pdserve.sim.profiles import AnalyticalProfile, ProfileError, parse_profile, timing_model
from pdserve.sim.timing import Chunk, LinearTiming, StepWork
from tests.sim.conftest import LLAMA_8B_SHAPE
from tests.test_config import parse

LLAMA_8B = {**LLAMA_8B_SHAPE, "vocab_size": 128256}


def decode_step(batch: int, context: int) -> StepWork:
    return StepWork.of([Chunk(context, 1, decode=True)] * batch, batch)


def prefill_step(tokens: int) -> StepWork:
    return StepWork.of([Chunk(0, tokens, decode=False)], 1)


def test_the_shape_counts_llama_3_1_8b():
    shape = ModelShape.from_config(LLAMA_8B, "bfloat16")
    assert abs(shape.weight_bytes / 2 - 8.03e9) < 0.01e9  # 8.03B parameters
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per token


def test_analytical_decode_is_memory_bound_and_prefill_compute_bound():
    h100 = timing_model(parse_profile("analytical:h100"), LLAMA_8B, "bfloat16")
    weights = ModelShape.from_config(LLAMA_8B, "bfloat16").weight_bytes
    # One decode step streams the weights at 80% of 3.35 TB/s, plus the 1 ms step overhead.
    expected = weights / (3.35e12 * 0.8) + 0.001
    assert h100.step_seconds(decode_step(1, 100)) == pytest.approx(expected, rel=0.01)
    # Bigger batches and contexts cost only their KV reads while memory-bound.
    assert h100.step_seconds(decode_step(32, 2000)) > h100.step_seconds(decode_step(1, 100))
    # A 4k-token prompt: 2 * params * tokens (+ attention) at 60% of 989 TFLOP/s.
    long_prompt = h100.step_seconds(prefill_step(4096))
    assert long_prompt > 2 * 7.5e9 * 4096 / (989e12 * 0.6)
    assert long_prompt == pytest.approx(2 * h100.step_seconds(prefill_step(2048)), rel=0.1)


def test_faster_hardware_and_tensor_parallelism_shorten_steps():
    def decode_seconds(spec: str) -> float:
        return timing_model(parse_profile(spec), LLAMA_8B, "bfloat16").step_seconds(
            decode_step(8, 1000)
        )

    assert decode_seconds("analytical:h200") < decode_seconds("analytical:h100")
    assert decode_seconds("analytical:h100") < decode_seconds("analytical:a100")
    assert decode_seconds("analytical:a100") < decode_seconds("analytical:l40s")
    tp2 = decode_seconds("analytical:h100:tp2")
    assert decode_seconds("analytical:h100") / 2 < tp2 < decode_seconds("analytical:h100")


@pytest.mark.parametrize(("gpu", "hop_us"), [("h100", 0.47), ("l40s", 1.0)])
def test_tensor_parallel_prices_two_ring_all_reduces_per_layer(gpu, hop_us):
    """What TP 4 adds over TP 1 once the step's own work is split: per layer, two ring
    all-reduces of the hidden states, each 2(N-1)/N x bytes / (link x 0.7) + NCCL's 3.6 us base
    latency + 2(N-1) hops (NVLink 0.47 us, PCIe 1.0 us)."""
    shape = ModelShape.from_config(LLAMA_8B, "bfloat16")
    step = decode_step(64, 1000)
    tp1 = timing_model(parse_profile(f"analytical:{gpu}"), LLAMA_8B, "bfloat16")
    tp4 = timing_model(parse_profile(f"analytical:{gpu}:tp4"), LLAMA_8B, "bfloat16")
    link = GPUS[gpu].link_bytes_per_s * 0.7
    size = 64 * 4096 * 2  # 64 new tokens' bfloat16 hidden states
    per_reduce = 6 / 4 * size / link + 3.6e-6 + 6 * hop_us * 1e-6
    overhead = 0.001
    split = (tp1.step_seconds(step) - overhead) / 4 + overhead
    assert tp4.step_seconds(step) == pytest.approx(split + 2 * shape.layers * per_reduce)


def test_json_profiles(tmp_path):
    linear = tmp_path / "cpu.json"
    coefficients = dict(step_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3, context_token_s=1e-6)
    linear.write_text(json.dumps({"kind": "linear", "device": "cpu", **coefficients}))
    timing = timing_model(parse_profile(str(linear)), LLAMA_8B, "bfloat16")
    work = StepWork.of([Chunk(0, 100, decode=False), Chunk(50, 1, decode=True)], 2)
    assert timing == LinearTiming(**coefficients)
    assert timing.step_seconds(work) == pytest.approx(0.01 + 100e-4 + 1e-3 + 151e-6)
    analytical = tmp_path / "h100-tp4.json"
    analytical.write_text(json.dumps({"kind": "analytical", "gpu": "H100", "tp": 4,
                                      "efficiency": {"compute": 0.5}}))  # fmt: skip
    profile = parse_profile(str(analytical))
    assert isinstance(profile, AnalyticalProfile)
    assert (profile.gpu, profile.tp, profile.efficiency.compute) == ("h100", 4, 0.5)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "unknown GPU 'b200' (known: a100, h100, h200, l40s)"),
        ("{not json", "not readable JSON"),
        ('{"kind": "fitted"}', 'needs an object with "kind": one of analytical, linear'),
        ('{"kind": "linear", "step_s": 1}', "missing 'prefill_token_s' (needs step_s, "),
        ('{"kind": "linear", "step_s": -1}', "'step_s' must be a non-negative number, got -1"),
        ('{"kind": "analytical", "gpu": "h100", "tp": 0}', "must be at least 1, got 0"),
        ('{"kind": "analytical", "gpu": "h100", "efficiency": {"mfu": 1}}', "unknown efficiency"),
        ('{"kind": "analytical", "gpu": "h100", "efficiency": {"memory": 2}}', "in (0, 1]"),
    ],
)
def test_unknown_or_malformed_profiles_are_one_line_errors(tmp_path, content, message):
    spec = "analytical:b200"
    if content is not None:
        spec = str(tmp_path / "profile.json")
        (tmp_path / "profile.json").write_text(content)
    with pytest.raises(ProfileError) as error:
        parse_profile(spec)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_bad_profile_names_its_flag():
    with pytest.raises(ConfigError, match=r"^SimConfig\.profile: 'h100' is neither"):
        SimConfig(profile="h100")
    with pytest.raises(CommandError, match=r"^--sim-profile: analytical:tpu: unknown GPU"):
        parse("--engine", "sim", "--sim-profile", "analytical:tpu")
    with pytest.raises(CommandError, match=r"^--decode-engine: simulated workers need --kv-trans"):
        parse("--decode-engine", "sim", "--kv-transport", "collective")


def test_per_pool_engines():
    config = parse("--prefill-engine", "sim", "--sim-profile", "analytical:a100:tp2")
    assert config.engine_for("prefill").kind == "sim"
    assert config.engine_for("decode").kind == "torch"
    assert config.engine_for("prefill").sim.profile == "analytical:a100:tp2"
    assert parse("--engine", "sim").engine_for("decode").kind == "sim"
    assert set(GPUS) == {"a100", "h100", "h200", "l40s"}


def test_a_linear_profile_without_the_prompt_step_cost_reads_as_zero(tmp_path):
    path = tmp_path / "older.json"
    coefficients = {"step_s": 0.01, "prefill_token_s": 1e-5, "decode_seq_s": 1e-4}
    path.write_text(json.dumps({"kind": "linear", **coefficients, "context_token_s": 0}))
    assert parse_profile(str(path)).prefill_step_s == 0.0
    prompt_step = StepWork.of([Chunk(0, 10, decode=False)], 1)
    path.write_text(
        json.dumps({"kind": "linear", **coefficients, "context_token_s": 0, "prefill_step_s": 0.02})
    )
    assert parse_profile(str(path)).step_seconds(prompt_step) == pytest.approx(0.01 + 1e-4 + 0.02)
