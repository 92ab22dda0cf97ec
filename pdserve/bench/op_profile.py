"""Where a step's time goes: torch.profiler's self CPU time per op, as shares of the wall time.

`bench engine --op-profile` prints it for the engine's decode steps at the largest batch: the
matrix multiplies' share is the part no engine-side change can shrink (transformers runs the same
multiplies); the rest (attention's KV reads, norms, RoPE, sampling, Python) is the engine's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Ops that are matrix multiplies of the weights: nn.Linear lowers to mm (addmm with a bias);
# models.linear.Linear on the CPU to oneDNN's linear over a reordered weight.
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"})


@dataclass(frozen=True)
class OpShare:
    name: str
    calls: int
    seconds: float  # self CPU time over the whole profiled run


@dataclass(frozen=True)
class OpProfile:
    wall_seconds: float
    ops: list[OpShare]  # by self time, longest first

    @property
    def matmul_seconds(self) -> float:
        return sum(op.seconds for op in self.ops if op.name in MATMUL_OPS)

    @property
    def non_matmul_share(self) -> float:
        """Share of the wall time not spent in weight matmuls (other ops, Python, waits)."""
        return 1.0 - self.matmul_seconds / self.wall_seconds


def profile_ops(run: Callable[[], object]) -> OpProfile:
    """Runs `run` once under torch.profiler (CPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    ops = [
        OpShare(e.key, e.count, e.self_cpu_time_total / 1e6)
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    ]
    ops.sort(key=lambda op: -op.seconds)
    return OpProfile(wall, ops)


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
    return "\n".join(lines)
