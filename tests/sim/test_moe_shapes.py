"""Mixture-of-experts shapes in the analytical profile: active parameters for FLOPs, every
parameter for memory, and the experts a step's tokens touch for its weight reads."""

from __future__ import annotations

import json

import pytest

from pdserve.sim.gpus import gpu_spec
from pdserve.sim.model_shape import ModelShape, gpu_kv_blocks
from pdserve.sim.profiles import ProfileError, parse_profile, timing_model
from pdserve.sim.shapes import shape_config
from pdserve.sim.timing import AnalyticalTiming, Chunk, StepWork


def shape(name: str) -> ModelShape:
    return ModelShape.from_config(shape_config(name), "bfloat16")


def active_params(s: ModelShape) -> int:
    return s.body_params + s.lm_head_params * (1 if s.tied_embeddings else 2)


@pytest.mark.parametrize(
    "name, total_b, active_b",
    # The model cards' counts: Qwen3-30B-A3B 30.5B / 3.3B, Qwen3-235B-A22B 235B / 22B,
    # Mixtral-8x7B 46.7B / 12.9B.
    [("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235.1, 22.2), ("mixtral-8x7b", 46.7, 12.9)],
)
def test_total_and_active_parameters_are_the_published_ones(name, total_b, active_b):
    s = shape(name)
    assert s.weight_bytes / 2 / 1e9 == pytest.approx(total_b, abs=0.1)
    assert active_params(s) / 1e9 == pytest.approx(active_b, abs=0.1)


def test_experts_touched_grow_with_the_batch_to_all_of_them():
    moe = shape("qwen3-235b-a22b").moe
    assert moe.experts_touched(1) == pytest.approx(8)
    # 32 tokens x 8 choices of 128 experts: 128 (1 - (120/128)^32) = 109.4 distinct experts
    assert moe.experts_touched(32) == pytest.approx(128 * (1 - (120 / 128) ** 32))
    assert moe.experts_touched(4096) == pytest.approx(128)


def test_a_decode_step_reads_the_touched_experts_only():
    s = shape("qwen3-235b-a22b")
    reads = [s.step_weight_bytes(b) for b in (1, 8, 32, 256, 4096)]
    assert reads == sorted(reads)
    expert_bytes = s.expert_params * s.dtype_bytes * s.moe.sparse_layers
    assert reads[0] == pytest.approx(s.weight_bytes - 120 * expert_bytes)
    assert reads[-1] == pytest.approx(s.weight_bytes)
    dense = shape("llama-3.1-70b")
    assert dense.step_weight_bytes(1) == dense.weight_bytes


def test_step_time_prices_active_flops_touched_weights_and_imbalance():
    s, h100 = shape("qwen3-235b-a22b"), gpu_spec("h100")
    even = AnalyticalTiming(s, h100, tp=8, expert_imbalance=1.0)
    skewed = AnalyticalTiming(s, h100, tp=8, expert_imbalance=1.5)
    prefill = StepWork.of([Chunk(0, 4096, False)], 1)
    flops = (
        2 * s.body_params * 4096
        + 2 * s.lm_head_params
        + s.attention_flops_per_pair * (4096 * 4097 // 2)
    )
    assert even.compute_seconds(prefill) == pytest.approx(flops / (8 * h100.bf16_flops * 0.6))
    routed = 2 * s.routed_active_params * 4096 * 0.5  # the extra half of the busiest GPU
    assert skewed.compute_seconds(prefill) - even.compute_seconds(prefill) == pytest.approx(
        routed / (8 * h100.bf16_flops * 0.6)
    )
    one = even.step_seconds(StepWork.of([Chunk(1000, 1, True)], 1))
    many = even.step_seconds(StepWork.of([Chunk(1000, 1, True)] * 64, 64))
    assert one < many < 64 * one  # more experts touched per step, each read once


def test_memory_counts_every_expert(tmp_path):
    config = shape_config("qwen3-235b-a22b")
    with pytest.raises(ValueError, match="--tp 4: the weights \\(470 GB\\) do not fit"):
        gpu_kv_blocks(config, "h100", 4, "bfloat16", 16)
    assert gpu_kv_blocks(config, "h100", 8, "bfloat16", 16) > 0


def test_expert_imbalance_from_a_profile_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kind": "analytical", "gpu": "h100", "expert_imbalance": 1.4}))
    timing = timing_model(parse_profile(str(path)), shape_config("mixtral-8x7b"), "bfloat16")
    assert timing.expert_imbalance == 1.4
    path.write_text(json.dumps({"kind": "analytical", "gpu": "h100", "expert_imbalance": 0.5}))
    with pytest.raises(ProfileError, match='"expert_imbalance" must be a number >= 1'):
        parse_profile(str(path))
