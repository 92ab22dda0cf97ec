"""Where a step's time goes: torch.profiler's self time per op, as shares of the wall time.

`bench engine --op-profile` prints it for the engine's decode steps at the largest batch: the
matrix multiplies' share is the part no engine-side change can shrink (transformers runs the same
multiplies); the rest (attention's KV reads, norms, RoPE, sampling, Python) is the engine's own.
On the CPU an op's time is its self CPU time. On a GPU it is each kernel's device time: the host
only launches there (or replays a CUDA graph, whose kernels the profiler still sees), and the
share of the wall time no kernel covers is the GPU waiting for the host.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

# Ops that are matrix multiplies of the weights: nn.Linear lowers to mm (addmm with a bias);
# models.linear.Linear on the CPU to oneDNN's linear over a reordered weight.
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"})
# GPU kernels of weight matmuls, by name: cuBLAS(Lt)'s gemm and gemv kernels (nvjet_* on Hopper,
# *_gemm_* / *gemv* elsewhere, splitKreduce finishing a split-K gemm) and CUTLASS gemms.
# Attention kernels may be built on CUTLASS too, so names naming attention are not matmuls.
_GPU_MATMUL = re.compile(r"gemm|gemv|nvjet|splitKreduce", re.IGNORECASE)
_GPU_ATTENTION = re.compile(r"flash|fmha|attention|attn", re.IGNORECASE)


def is_weight_matmul(name: str) -> bool:
    """Whether a profiled op (CPU) or kernel (GPU) is a weight matmul."""
    if name in MATMUL_OPS:
        return True
    return bool(_GPU_MATMUL.search(name)) and not _GPU_ATTENTION.search(name)


@dataclass(frozen=True)
class OpShare:
    name: str
    calls: int
    seconds: float  # self time over the whole profiled run (CPU: the op's; GPU: the kernel's)


@dataclass(frozen=True)
class OpProfile:
    wall_seconds: float
    ops: list[OpShare]  # by self time, longest first
    device: str = "cpu"  # "cuda": ops are GPU kernels, timed on the device

    @property
    def matmul_seconds(self) -> float:
        return sum(op.seconds for op in self.ops if is_weight_matmul(op.name))

    @property
    def non_matmul_share(self) -> float:
        """Share of the wall time not spent in weight matmuls (other ops, Python, waits)."""
        return 1.0 - self.matmul_seconds / self.wall_seconds


def profile_ops(run: Callable[[], object], device: str = "cpu") -> OpProfile:
    """Runs `run` once under torch.profiler: CPU ops, or on a CUDA `device` its kernels."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        if on_gpu:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    if on_gpu:  # the kernels' rows: a CPU op's device time is its kernels', counted there
        ops = [
            OpShare(e.key, e.count, e.self_device_time_total / 1e6)
            for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
        ]
    else:
        ops = [
            OpShare(e.key, e.count, e.self_cpu_time_total / 1e6)
            for e in prof.key_averages()
            if e.self_cpu_time_total > 0
        ]
    ops.sort(key=lambda op: -op.seconds)
    return OpProfile(wall, ops, "cuda" if on_gpu else "cpu")


def format_profile(profile: OpProfile, steps: int, top: int = 10) -> str:
    """A table of the `top` ops per step (calls, ms, share of wall time) and the matmul share."""
    lines = [f"{'op':<52} {'calls/step':>10} {'ms/step':>8} {'of step':>8}"]
    for op in profile.ops[:top]:
        lines.append(
            f"{op.name[:52]:<52} {op.calls / steps:>10.1f} {op.seconds * 1e3 / steps:>8.2f} "
            f"{op.seconds / profile.wall_seconds:>7.1%}"
        )
    step_ms = profile.wall_seconds * 1e3 / steps
    lines.append(
        f"step {step_ms:.2f} ms wall: weight matmuls {1 - profile.non_matmul_share:.1%}, "
        f"everything else {profile.non_matmul_share:.1%}"
    )
    if profile.device == "cuda":
        busy = sum(op.seconds for op in profile.ops) / profile.wall_seconds
        lines.append(f"GPU busy (any kernel) {busy:.1%} of the wall time, idle {1 - busy:.1%}")
    return "\n".join(lines)
