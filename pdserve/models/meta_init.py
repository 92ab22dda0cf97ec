"""What a model built on the meta device (as the loader builds it) skips: random inits and
tables the checkpoint or the loader replace once the model is materialized.

Random init on the meta device runs torch's Python references, whose first use imports
torch._dynamo: about 1 s of every worker's start, for values nobody reads.
"""

from __future__ import annotations

import torch


def building_on_meta() -> bool:
    return torch.get_default_device().type == "meta"


def uninitialized(rows: int, cols: int) -> torch.Tensor | None:
    """A weight to give nn.Embedding when building on the meta device, so it draws no random
    init; None elsewhere (its own init, which a model built directly keeps)."""
    return torch.empty(rows, cols) if building_on_meta() else None
