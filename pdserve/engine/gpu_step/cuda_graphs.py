"""The compiled decode step's CUDA graphs, captured by hand: one per static input shape,
replayed after one copy of the step's inputs.

torch.compile's mode="reduce-overhead" captures the same graphs through CUDA-graph trees, but
each call still runs dynamo's guards and the trees' bookkeeping and copies each input into its
placeholder: 0.2-0.4 ms of host time per step on an H100 (BENCHMARKS.md, "Sixth lease"), while
a small model's batch-32 step is 0.6 ms of GPU work. Here the compiled function runs only to
warm up and be captured; a step is one host-to-device copy of a flat int64 buffer and a replay,
as vLLM replays its decode graphs. (CUDA only: the tests here have no GPU; `pdserve selftest
--device cuda` checks the compiled steps' tokens against the eager ones.)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the static device buffer the graph reads
    rows: int  # the rows of the results buffer the graph writes


class CudaGraphs:
    """Captured graphs by key. They share one memory pool (they never run concurrently) and
    write their outputs into one results buffer: a graph's own output would stay allocated
    as long as the graph, and with a [batch, vocab] float32 output per (batch bucket, width)
    pair that grew by ~65 MB per width at a 128k vocabulary and 64 sequences."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        """`max_rows`: the most rows any graph's output has (the largest batch bucket)."""
        self.device = device
        self.max_rows = max_rows
        self.pool = torch.cuda.graph_pool_handle()
        # One stream for every warm-up: the memory their runs free stays cached for it, and
        # a stream per capture would each keep some.
        self._warm_up_stream = torch.cuda.Stream(device)
        self._captured: dict[Hashable, _Captured] = {}
        self._results: torch.Tensor | None = None  # [max_rows, ...], made at the first capture

    def run(
        self,
        key: Hashable,
        inputs: torch.Tensor,
        forward: Callable[[torch.Tensor], torch.Tensor],
        prepare: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """`forward(inputs on the device)` through the graph captured for `key` (captured now
        on first use). `inputs` (on the host) must have the same shape for the same key.
        `prepare` amends the inputs in place once on the device, before the graph reads them.
        The result is a view of the results buffer: read it before the next run."""
        captured = self._captured.get(key)
        if captured is None:
            captured = self._captured[key] = self._capture(inputs, forward, prepare)
        # From pageable host memory the copy is staged at once, so `inputs` may be freed.
        captured.inputs.copy_(inputs, non_blocking=True)
        if prepare is not None:
            prepare(captured.inputs)
        captured.graph.replay()
        assert self._results is not None
        return self._results[: captured.rows]

    def _capture(
        self,
        inputs: torch.Tensor,
        forward: Callable[[torch.Tensor], torch.Tensor],
        prepare: Callable[[torch.Tensor], None] | None,
    ) -> _Captured:
        static = inputs.to(self.device)
        if prepare is not None:  # the warm-up runs read real inputs too
            prepare(static)
        current, side = torch.cuda.current_stream(self.device), self._warm_up_stream
        side.wait_stream(current)
        # Outside the capture, compile and let the kernels' first launches allocate and tune.
        # These runs write this step's K/V rows, which the replay then writes again (the same
        # values: each row's K/V depends only on its token and position).
        with torch.cuda.stream(side):
            for _ in range(2):
                warm = forward(static)
        current.wait_stream(side)
        results = self._results_for(warm)
        graph = torch.cuda.CUDAGraph()
        # "thread_local": transfer threads writing received KV blocks meanwhile are not part
        # of the capture and must not fail it.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            # The graph's own output is an intermediate, freed to the pool after the capture.
            results[: warm.shape[0]].copy_(forward(static))
        return _Captured(graph, static, warm.shape[0])

    def _results_for(self, output: torch.Tensor) -> torch.Tensor:
        """The results buffer, made (outside any capture) for outputs shaped like `output`."""
        if self._results is None:
            shape = (self.max_rows, *output.shape[1:])
            self._results = torch.empty(shape, dtype=output.dtype, device=self.device)
        fits = output.shape[0] <= self.max_rows and output.shape[1:] == self._results.shape[1:]
        if not fits or output.dtype != self._results.dtype:
            raise ValueError(
                f"a graph output {tuple(output.shape)} {output.dtype} does not fit the results "
                f"buffer {tuple(self._results.shape)} {self._results.dtype}"
            )
        return self._results
