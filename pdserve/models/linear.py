"""`Linear`: nn.Linear whose forward over a few rows on the CPU takes the faster of two GEMM
layouts.

Decode and speculative verification multiply a handful of rows by every weight. With the
weight stored as nn.Linear keeps it ([out, in]), `F.linear(x, W)` computes x @ W^T; MKL's
float32 kernels for that are slow at 1-3 rows on the CPUs measured here (one thread, all the
`small` preset's weights in turn, cache-cold, BENCHMARKS.md "2026-11-26 (HA)"): 10.3 ms at 1
row, 16.8 at 2, 21 at 3, 16.4 at 5. The same product computed the other way round,
(W @ x^T)^T, costs 5.9 ms at 2 rows, 9.6 at 3, 12.3 at 5 and is no faster from 7 rows on; its
1-row case is a matrix-vector product (10.4 ms), so a single row is duplicated and run as two.
The weight's layout is unchanged (checkpoints, tying, KV transfer and CUDA are unaffected); only
the kernel differs, so results differ from F.linear's in rounding only, as F.linear's own
1-row and many-row kernels already do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Most rows that take the (W @ x^T)^T path: measured faster up to 6 rows, no faster from 7.
SMALL_ROWS = 6


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if (
            rows > SMALL_ROWS
            or x.dim() != 2
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or torch.compiler.is_compiling()
        ):
            return F.linear(x, self.weight, self.bias)
        wide = x.expand(2, -1).contiguous() if rows == 1 else x
        out = (self.weight @ wide.t()).t()[:rows].contiguous()
        return out if self.bias is None else out.add_(self.bias)
