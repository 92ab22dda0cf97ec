"""`Linear`: nn.Linear whose CPU forward uses the fastest GEMM measured for the rows at hand.

Two kernels beat `F.linear(x, W)` (x @ W^T through MKL) on the CPUs measured here; every weight
of the `small` preset in turn, cache-cold, ms per pass (BENCHMARKS.md "2026-11-26 (HA)" and
"seventh session"):

- Few rows, float32: (W @ x^T)^T. MKL's x @ W^T is slow at 1-3 rows (one thread: 10.3 ms at
  1 row, 16.8 at 2); the other way round costs 5.9 at 2 rows. Its 1-row case is a
  matrix-vector product (10.4 ms), so a single row is duplicated and run as two.
- From 4 rows, and in bfloat16 at any count: oneDNN with the weight reordered once into its
  blocked layout (`mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing does).
  Two threads, float32: 8 rows 6.4 ms against 13.5, 32 rows 11.5 against 20.5, 256 rows 68
  against 89; bfloat16 32 rows 6.9 against 9.1. F.linear hands MKL the weight as stored, and
  MKL packs it again on every call.

The checkpoint's weight stays as it is (state dicts, tying, KV transfer and CUDA are
unaffected); the reordered copy is made on first use and again whenever the weight changes
(its storage or version). Results differ from F.linear's in rounding only, as F.linear's own
1-row and many-row kernels already do. Autograd, torch.compile, CUDA and other dtypes take
F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Most rows that take the (W @ x^T)^T path in float32: faster than oneDNN up to 3 rows.
SMALL_ROWS = 3
# The row count oneDNN's weight layout is chosen for: decode batches; 1 chose a layout ~30%
# slower at 4-32 rows, 8 to 256 measured alike.
PACK_ROWS = 32
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)
# A module-level name, so that bench/step_phases.py can time the weight matmuls through it.
onednn_linear = torch.ops.mkldnn._linear_pointwise.default if ONEDNN else None
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


class Linear(nn.Linear):
    _packed: torch.Tensor | None = None
    _packed_of: tuple[int, int, torch.dtype] | None = None  # (data_ptr, version, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.device.type != "cpu" or x.dtype != weight.dtype or torch.compiler.is_compiling():
            return F.linear(x, weight, self.bias)
        rows = x.shape[0]
        if x.dtype == torch.float32 and x.dim() == 2 and rows <= SMALL_ROWS:
            wide = x.expand(2, -1).contiguous() if rows == 1 else x
            out = (weight @ wide.t()).t()[:rows].contiguous()
            return out if self.bias is None else out.add_(self.bias)
        trains = weight.requires_grad and torch.is_grad_enabled()  # oneDNN's op has no backward
        packed = None if trains else self._packed_weight()
        if packed is None:
            return F.linear(x, weight, self.bias)
        return onednn_linear(x, packed, self.bias, "none", [], "")

    def _packed_weight(self) -> torch.Tensor | None:
        weight = self.weight
        if not ONEDNN or weight.dtype not in _PACKED_DTYPES:
            return None
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if self._packed_of != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self._packed_of = key
        return self._packed
