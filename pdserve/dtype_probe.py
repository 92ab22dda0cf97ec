"""The dtype tried on the device before the workers start: one matmul through the model's own
linear path (pdserve/models/linear.py), so an unsupported dtype is one line at start-up, not a
failed engine step on every request after the server said it was ready.

On CPU, bfloat16 goes through oneDNN, which needs AVX-512 (BW, VL and DQ) or AVX-NE-CONVERT
(torch's mkldnn_bf16_device_check); without them the first forward fails. The CPU's features
come from /proc/cpuinfo; PDSERVE_HIDE_CPU_FEATURES (comma-separated flags, e.g. avx512bw) hides
some, to see how start-up treats a CPU without them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.startup_checks import StartupError

HIDE_ENV = "PDSERVE_HIDE_CPU_FEATURES"
# dtype -> alternatives, each a set of /proc/cpuinfo flags that is enough on its own.
CPU_FEATURES_NEEDED: dict[str, tuple[tuple[str, str], ...]] = {
    "bfloat16": (
        ("AVX-512 BW/VL/DQ", "avx512bw avx512vl avx512dq"),
        ("AVX-NE-CONVERT", "avx_ne_convert"),
    ),
}


def check_dtype(dtype: str, device: str) -> None:
    """StartupError, one line naming the CPU feature and the alternative, when `dtype` cannot
    run on `device`; otherwise a 4x64 by 64x64 product through the model's Linear."""
    if device == "cpu":
        _check_cpu_features(dtype, cpu_flags())
    import torch

    from pdserve.models.linear import Linear

    try:
        with torch.no_grad():  # not inference_mode: Linear keys its packed weight on _version
            layer = Linear(64, 64, bias=False, dtype=getattr(torch, dtype), device=device)
            layer(torch.ones(4, 64, dtype=layer.weight.dtype, device=device))
    except (RuntimeError, TypeError, AssertionError) as e:
        lines = str(e).strip().splitlines()
        detail = lines[0].rstrip(".") if lines else type(e).__name__
        other = "; use --dtype float32" if dtype != "float32" else ""
        raise StartupError(f"--dtype {dtype} on {device}: {detail}{other}") from e


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags less the hidden ones; None where /proc/cpuinfo is not there."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return None
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    hidden = {flag.strip() for flag in os.environ.get(HIDE_ENV, "").split(",")}
    return set(flags.partition(":")[2].split()) - hidden


def _check_cpu_features(dtype: str, flags: set[str] | None) -> None:
    alternatives = CPU_FEATURES_NEEDED.get(dtype)
    if not alternatives or flags is None:
        return
    if any(set(needed.split()) <= flags for _, needed in alternatives):
        return
    names = " or ".join(name for name, _ in alternatives)
    missing = sorted({flag for _, needed in alternatives for flag in needed.split()} - flags)
    raise StartupError(
        f"--dtype {dtype} on this CPU needs {names} (missing: {', '.join(missing)}); "
        "use --dtype float32"
    )
