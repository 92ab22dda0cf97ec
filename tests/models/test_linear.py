"""models/linear.py and linear_kernels.py: every GEMM path computes what F.linear computes (to
rounding); the layer runs the path measured fastest on this CPU, among those the CPU can run
(never oneDNN's bfloat16 reorder under a forced AVX2 capability, and bfloat16 works end to end
there); the choices are written to the cache file and read back by the next start without
measuring; a corrupt cache file is ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.models import linear_kernels
from pdserve.models.cpu_features import CpuFeatures, cpu_features
from pdserve.models.linear import Linear, choose_kernels, probe_dtype
from pdserve.models.linear_kernels import ONEDNN, KernelChoices, bucket, candidates, gemm, pack

ROWS = [1, 2, 3, 4, 5, 32, 257]
AVX512 = CpuFeatures("test CPU", "AVX512", frozenset({"avx2", "avx512f", "avx512bw"}), True)
# The same hardware with torch's dispatch forced down (ATEN_CPU_CAPABILITY=avx2), oneDNN not.
FORCED_AVX2 = replace(AVX512, capability="AVX2")
EMULATE_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


@pytest.fixture
def choices(tmp_path, monkeypatch):
    """The process's choices, read from and written to a fresh file for this test."""
    fresh = KernelChoices(tmp_path / "kernels.json")
    monkeypatch.setattr(linear_kernels, "_choices", fresh)
    return fresh


def _runnable(dtype: torch.dtype) -> list[str]:
    return sorted({name for rows in ROWS for name in candidates(dtype, rows, cpu_features())})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_this_cpu_runs_matches_f_linear_at_every_row_count(dtype, bias):
    torch.manual_seed(0)
    weight = torch.randn(160, 96, dtype=dtype)
    b = torch.randn(160, dtype=dtype) if bias else None
    packed = pack(weight) if ONEDNN and "packed" in _runnable(dtype) else None
    # bfloat16: the few-row path rounds the product before adding the bias (F.linear after).
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    )
    with torch.inference_mode():
        for path in _runnable(dtype):
            for rows in ROWS:
                x = torch.randn(rows, 96, dtype=dtype)
                out = gemm(path, x, weight, b, packed)
                assert out.shape == (rows, 160) and out.is_contiguous(), (path, rows)
                torch.testing.assert_close(out, F.linear(x, weight, b), **tolerance)


def test_the_layer_matches_f_linear_through_the_chosen_paths(choices):
    torch.manual_seed(1)
    layer = Linear(96, 160, bias=True).requires_grad_(False)
    for rows in ROWS:
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    # A non-contiguous input (a column slice) and a 3-D input (early-exit logits) work too.
    wide = torch.randn(3, 192)[:, ::2]
    torch.testing.assert_close(layer(wide), F.linear(wide, layer.weight, layer.bias))
    cube = torch.randn(2, 3, 96)
    torch.testing.assert_close(layer(cube), F.linear(cube, layer.weight, layer.bias))
    assert choices.measurements == len({bucket(r) for r in [*ROWS, 6]})


def test_a_single_row_is_the_row_of_a_two_row_product():
    # One row runs as two identical rows: the same result as the row alone, not its neighbour's.
    torch.manual_seed(1)
    weight = torch.randn(32, 64)
    a, b = torch.randn(1, 64), torch.randn(1, 64)
    out_a = gemm("few_rows", a, weight, None, None)
    assert not torch.allclose(out_a, gemm("few_rows", b, weight, None, None))
    torch.testing.assert_close(out_a, F.linear(a, weight), rtol=1e-5, atol=1e-5)


def test_a_forced_avx2_capability_never_offers_onednns_bfloat16_reorder():
    for rows in ROWS:
        assert "packed" not in candidates(torch.bfloat16, bucket(rows), FORCED_AVX2)
        # float32's oneDNN path runs on AVX2 (where this torch has oneDNN at all).
        assert ("packed" in candidates(torch.float32, bucket(rows), FORCED_AVX2)) == ONEDNN
        assert ("packed" in candidates(torch.bfloat16, bucket(rows), AVX512)) == ONEDNN
    with_convert = replace(FORCED_AVX2, flags=FORCED_AVX2.flags | {"avx_ne_convert"})
    assert ("packed" in candidates(torch.bfloat16, 32, with_convert)) == ONEDNN
    assert "packed" not in candidates(torch.bfloat16, 32, replace(AVX512, onednn_bf16=False))


def test_a_cached_path_the_cpu_cannot_run_is_measured_again(tmp_path):
    path = tmp_path / "kernels.json"
    weight = torch.randn(64, 48, dtype=torch.bfloat16)
    first = KernelChoices(path, FORCED_AVX2)
    assert first.choose([weight], None, 32) != "packed"
    # A file that says otherwise (written on this CPU model with oneDNN allowed, or edited).
    data = json.loads(path.read_text())
    data["choices"] = dict.fromkeys(data["choices"], "packed")
    path.write_text(json.dumps(data))
    again = KernelChoices(path, FORCED_AVX2)
    assert again.choose([weight], None, 32) != "packed" and again.measurements == 1


def test_choices_are_written_and_the_next_start_reads_them_without_measuring(tmp_path):
    torch.manual_seed(2)
    model = torch.nn.Sequential(Linear(64, 96), Linear(96, 64), Linear(96, 64))
    path = tmp_path / "cache" / "kernels.json"  # its folder is made too
    first = KernelChoices(path)
    measured = [first.choose([m.weight.detach()], m.bias, rows) for m in model for rows in ROWS]
    # One measurement per shape and bucket: the two 96 -> 64 layers share theirs.
    assert first.measurements == 2 * len({bucket(r) for r in ROWS})
    stored = json.loads(path.read_text())["choices"]
    assert len(stored) == first.measurements and set(stored.values()) <= set(measured)
    machine = f"{cpu_features().model}|{cpu_features().isa}|"
    assert all(key.startswith(machine) for key in stored)
    second = KernelChoices(path)
    again = [second.choose([m.weight.detach()], m.bias, rows) for m in model for rows in ROWS]
    assert again == measured and second.measurements == 0


def test_engine_start_chooses_every_bucket_once(tmp_path, monkeypatch):
    monkeypatch.setattr(linear_kernels, "_choices", KernelChoices(tmp_path / "kernels.json"))
    model = torch.nn.Sequential(Linear(64, 96), Linear(96, 64)).requires_grad_(False)
    buckets = linear_kernels.buckets_up_to(40)
    assert buckets == [1, 2, 3, 4, 8, 16, 32]
    assert choose_kernels(model, 40) == 2 * len(buckets)
    assert choose_kernels(model, 40) == 0  # remembered in the process
    model(torch.randn(20, 64))  # a bucket met at start: nothing measured while serving
    assert linear_kernels.kernel_choices().measurements == 2 * len(buckets)


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "choices": [1]}', "[]", ""])
def test_a_corrupt_cache_file_is_ignored_and_replaced(tmp_path, content):
    path = tmp_path / "kernels.json"
    path.write_text(content)
    choices = KernelChoices(path)
    weight = torch.randn(48, 32)
    assert choices.choose([weight], None, 8) in linear_kernels.PATHS
    assert choices.measurements == 1
    assert len(json.loads(path.read_text())["choices"]) == 1


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")
def test_a_changed_weight_is_reordered_again_and_training_takes_f_linear(tmp_path, monkeypatch):
    torch.manual_seed(3)
    layer = Linear(64, 48, bias=False)
    path = tmp_path / "kernels.json"
    KernelChoices(path).choose([layer.weight.detach()], None, 16)
    data = json.loads(path.read_text())
    data["choices"] = dict.fromkeys(data["choices"], "packed")  # this run's file says packed
    path.write_text(json.dumps(data))
    monkeypatch.setattr(linear_kernels, "_choices", KernelChoices(path))
    x = torch.randn(16, 64)
    with torch.no_grad():
        before = layer(x)
        assert layer._packed is not None and layer._packed.is_mkldnn  # noqa: SLF001
        layer.weight.mul_(2.0)  # in place: a new version of the same storage
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(48, 64))  # new storage
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    out = layer(x)  # grad enabled, weight requires grad: F.linear, so backward works
    assert torch.equal(out, F.linear(x, layer.weight))
    out.sum().backward()
    assert layer.weight.grad is not None


def test_probe_dtype_passes_the_dtypes_this_cpu_runs(choices):
    assert probe_dtype(torch.float32, "cpu") is None
    assert probe_dtype(torch.bfloat16, "cpu") is None


# One forward of the built-in tiny model, bfloat16 and float32, in a process that sees an AVX2
# CPU: the paths it chose, its capability, and how far bfloat16's logits are from float32's.
_FORWARD = textwrap.dedent(
    """
    import json, torch
    from pdserve.engine.gpu_step.attention_batch import attention_context
    from pdserve.models.builtin import builtin_model_dir
    from pdserve.models.cpu_features import cpu_features
    from pdserve.models.linear import choose_kernels
    from pdserve.models.loader import load_model

    logits = {}
    for dtype in ("float32", "bfloat16"):
        model, _ = load_model(builtin_model_dir("tiny"), dtype)
        choose_kernels(model, 16)
        c = model.config
        cache = torch.zeros(c.num_layers, 2, 1, 16, c.num_kv_heads, c.head_dim,
                            dtype=getattr(torch, dtype))
        ctx = attention_context([0], [12], [[0]], list(range(12)), 16, torch.device("cpu"))
        with torch.inference_mode():
            ids = torch.arange(3, 15)
            logits[dtype] = model.compute_logits(model(ids, torch.arange(12), cache, ctx))
    f32, bf16 = logits["float32"], logits["bfloat16"]
    print(json.dumps({
        "capability": torch.backends.cpu.get_cpu_capability(),
        "runs_bf16_packed": cpu_features().runs_bf16_packed,
        "finite": bool(torch.isfinite(bf16).all()),
        "error": float((bf16 - f32).abs().max() / f32.abs().max()),
    }))
    """
)


def test_bfloat16_runs_end_to_end_on_an_emulated_avx2_cpu(tmp_path):
    cache = tmp_path / "kernels.json"
    env = {
        **os.environ,
        **EMULATE_AVX2,
        "PDSERVE_KERNEL_CACHE": str(cache),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    done = subprocess.run(
        [sys.executable, "-c", _FORWARD], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["capability"] == "AVX2" and not seen["runs_bf16_packed"]
    assert seen["finite"] and seen["error"] < 0.05
    chosen = json.loads(cache.read_text())["choices"]
    bf16 = {key: path for key, path in chosen.items() if "|bfloat16|" in key}
    assert bf16 and "packed" not in bf16.values()
    assert all("|AVX2|" in key for key in chosen)
