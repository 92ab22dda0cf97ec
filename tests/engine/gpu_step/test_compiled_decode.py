"""The --compile decode fast path: greedy tokens equal the eager engine's token for token over
batches that hit several padded sizes, under preemption and with prefix-cache hits, with the
decode rows' KV blocks read in place (the kernel of the device) and gathered (no kernel)."""

from __future__ import annotations

import time

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine import model_runner
from pdserve.engine.gpu_step.compiled_decode import (
    batch_buckets,
    bucket_for,
    use_compile,
    width_bucket,
)
from tests.engine.conftest import random_prompts

LENGTHS = [1, 3, 4, 5, 9, 16, 23, 40, 61]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
# 20 blocks of 4 tokens hold the longest request but not the batch: preemptions, and decode
# batches of every size from 8 down to 1 (buckets 1, 2, 4, 8).
SETTINGS = dict(num_kv_blocks=20, max_num_seqs=8)


def test_buckets_cover_every_batch_size():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(1) == [1]
    buckets = batch_buckets(12)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]


def test_width_pads_by_at_most_a_quarter_above_the_floor():
    assert width_bucket(1, 16) == 8  # 128 tokens
    assert width_bucket(8, 16) == 8
    assert width_bucket(9, 16) == 10  # steps of 2 blocks between 8 and 16
    assert width_bucket(33, 4) == 40
    assert width_bucket(65, 16) == 80  # a 1040-token context: 1280, not 2048
    widths = {width_bucket(n, 16) for n in range(1, 4097)}
    assert all(n <= width_bucket(n, 16) <= max(8, 1.25 * n) for n in range(1, 4097))
    assert len(widths) == 1 + 4 * 9  # the floor, then four per doubling from 8 to 4096 blocks


def test_compile_defaults_to_cuda_only():
    assert use_compile(None, "cuda:0") and not use_compile(None, "cpu")
    assert use_compile(True, "cpu") and not use_compile(False, "cuda")


@pytest.fixture(params=["read in place", "gathered"])
def kv_reads(request, monkeypatch) -> str:
    """Both ways the eager and compiled steps attend: the runner decides once, for both."""
    if request.param == "gathered":
        monkeypatch.setattr(model_runner, "reads_in_place", lambda *_: False)
    return request.param


def test_compiled_decode_matches_eager(make_engine, kv_reads):
    prompts = random_prompts(LENGTHS, seed=1)
    # The second pass hits the prefix cache: the longest prompts first, their blocks the
    # latest freed (the small pool evicted the others).
    extended = [p + [7, 8, 9] for p in reversed(prompts)]
    eager = make_engine(**SETTINGS)
    expected = [eager.generate(prompts, GREEDY), eager.generate(extended, GREEDY)]

    started = time.perf_counter()
    engine = make_engine(compile=True, **SETTINGS)
    got = [engine.generate(prompts, GREEDY), engine.generate(extended, GREEDY)]
    compile_and_run_s = time.perf_counter() - started

    assert got == expected
    stats = engine.stats()
    compiled = engine.executor.runner.compiled_decode
    assert compiled.in_place == (kv_reads == "read in place")
    assert stats["compiled_decode_steps"] > 0
    assert stats["num_preemptions"] > 0
    assert stats["prefix_hit_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert {batch for batch, _ in compiled.shapes} >= {1, 2, 4, 8}
    print(f"compiled engine: {compile_and_run_s:.1f} s, graphs {sorted(compiled.shapes)}")


def test_eager_engine_has_no_compiled_path(make_engine):
    engine = make_engine()
    assert engine.executor.runner.compiled_decode is None
    assert "compiled_decode_steps" not in engine.stats()


def test_compiled_decode_matches_eager_across_widths_above_the_floor(make_engine, kv_reads):
    """Contexts of 33-63 blocks of 4 tokens, one request at a time: block tables padded to
    widths 40, 48, 56 and 64 (steps of 8 blocks between 32 and 64), each its own graph, the
    padded entries masked out or never read."""
    prompts = random_prompts([129, 150, 200, 230], seed=2)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    eager = make_engine(num_kv_blocks=80)
    engine = make_engine(compile=True, num_kv_blocks=80)
    for prompt in prompts:
        assert engine.generate([prompt], params) == eager.generate([prompt], params)
    widths = {width for _, width in engine.executor.runner.compiled_decode.shapes}
    assert widths == {40, 48, 56, 64}
