"""The compiled decode step's CUDA graphs, captured by hand: one per static input shape,
replayed after one copy of the step's inputs.

torch.compile's mode="reduce-overhead" captures the same graphs through CUDA-graph trees, but
each call still runs dynamo's guards and the trees' bookkeeping and copies each input into its
placeholder: 0.2-0.4 ms of host time per step on an H100 (BENCHMARKS.md, "Sixth lease"), while
a small model's batch-32 step is 0.6 ms of GPU work. Here the compiled function runs only to
warm up and be captured; a step is one host-to-device copy of a flat int64 buffer and a replay,
as vLLM replays its decode graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the static device buffer the graph reads
    output: torch.Tensor  # the static buffer it writes, overwritten by each replay


class CudaGraphs:
    """Captured graphs by key; all share one memory pool (they never run concurrently)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._captured: dict[Hashable, _Captured] = {}

    def run(
        self,
        key: Hashable,
        inputs: torch.Tensor,
        forward: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`forward(inputs on the device)` through the graph captured for `key` (captured now
        on first use). `inputs` (on the host) must have the same shape for the same key. The
        result is the graph's output buffer: read it before the next run."""
        captured = self._captured.get(key)
        if captured is None:
            captured = self._captured[key] = self._capture(inputs, forward)
        # From pageable host memory the copy is staged at once, so `inputs` may be freed.
        captured.inputs.copy_(inputs, non_blocking=True)
        captured.graph.replay()
        return captured.output

    def _capture(
        self, inputs: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor]
    ) -> _Captured:
        static = inputs.to(self.device)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        # Outside the capture, compile and let the kernels' first launches allocate and tune.
        # These runs write this step's K/V rows, which the replay then writes again (the same
        # values: each row's K/V depends only on its token and position).
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(static)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # "thread_local": transfer threads writing received KV blocks meanwhile are not part
        # of the capture and must not fail it.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = forward(static)
        return _Captured(graph, static, output)
