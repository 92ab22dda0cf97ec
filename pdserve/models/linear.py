"""`Linear`: nn.Linear whose CPU forward runs the GEMM measured fastest on this CPU for the rows
at hand (linear_kernels.py: F.linear, (W @ x^T)^T for few rows, or oneDNN over a reordered
weight).

The checkpoint's weight stays as it is (state dicts, tying, KV transfer and CUDA are
unaffected); oneDNN's reordered copy is made on first use of that path and again whenever the
weight changes (its storage or version). Results differ from F.linear's in rounding only, as
F.linear's own 1-row and many-row kernels already do. Autograd, torch.compile, CUDA and other
dtypes than the weight's take F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models import linear_kernels
from pdserve.models.cpu_features import cpu_features


class Linear(nn.Linear):
    _packed: torch.Tensor | None = None
    _packed_of: tuple[int, int, torch.dtype] | None = None  # (data_ptr, version, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        trains = weight.requires_grad and torch.is_grad_enabled()  # oneDNN's op has no backward
        if (
            x.device.type != "cpu"
            or x.dtype != weight.dtype
            or trains
            or torch.compiler.is_compiling()
        ):
            return F.linear(x, weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        path = linear_kernels.kernel_choices().choose([weight], self.bias, rows.shape[0])
        packed = self._packed_weight() if path == "packed" else None
        out = linear_kernels.gemm(path, rows, weight, self.bias, packed)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if self._packed_of != key:
            self._packed = linear_kernels.pack(weight)
            self._packed_of = key
        return self._packed


def choose_kernels(model: nn.Module, max_rows: int) -> int:
    """Chooses (measures, unless the cache file has them) the path of every Linear shape of
    `model` for every rows bucket up to `max_rows`, so that serving never stops to measure;
    returns how many choices were measured. CPU models only."""
    by_shape: dict[tuple, list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu":
            key = (module.weight.dtype, tuple(module.weight.shape), module.bias is not None)
            by_shape.setdefault(key, []).append(module)
    choices = linear_kernels.kernel_choices()
    before = choices.measurements
    for layers in by_shape.values():
        for rows in linear_kernels.buckets_up_to(max_rows):
            choices.choose((layer.weight.detach() for layer in layers), layers[0].bias, rows)
    return choices.measurements - before


def probe_dtype(dtype: torch.dtype, device: str | torch.device) -> str | None:
    """None when a layer's matmul runs in `dtype` on `device` through the path this machine
    chooses and gives finite numbers; otherwise why not, in one line (for start-up checks)."""
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    layer = Linear(64, 64, bias=False, device="meta")
    layer.weight = nn.Parameter(weight.to(device, dtype), requires_grad=False)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    where = cpu_features().describe() if torch.device(device).type == "cpu" else str(device)
    try:
        out = layer(x)
    except RuntimeError as e:
        return f"{dtype} matmuls fail on {where}: {str(e).splitlines()[0]}"
    if not torch.isfinite(out).all():
        return f"{dtype} matmuls give non-finite numbers on {where}"
    return None
