"""models/linear.py: the few-rows CPU path computes what F.linear computes (to rounding), with
and without bias, for every row count, and many rows take F.linear itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.models.linear import SMALL_ROWS, Linear


@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_for_every_row_count(bias):
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    for rows in range(1, SMALL_ROWS + 3):
        x = torch.randn(rows, 96)
        out = layer(x)
        assert out.shape == (rows, 160) and out.is_contiguous()
        want = F.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        if rows > SMALL_ROWS:
            assert torch.equal(out, want)
    # A non-contiguous input (a column slice) and a 3-D input (early-exit logits) work too.
    wide = torch.randn(3, 192)[:, ::2]
    torch.testing.assert_close(layer(wide), F.linear(wide, layer.weight, layer.bias))
    cube = torch.randn(2, 3, 96)
    assert torch.equal(layer(cube), F.linear(cube, layer.weight, layer.bias))


def test_linear_single_row_is_the_row_of_a_two_row_product():
    # One row runs as two identical rows: the same result as the row alone, not its neighbour's.
    torch.manual_seed(1)
    layer = Linear(64, 32, bias=False)
    a, b = torch.randn(1, 64), torch.randn(1, 64)
    assert not torch.allclose(layer(a), layer(b))
    torch.testing.assert_close(layer(a), F.linear(a, layer.weight), rtol=1e-5, atol=1e-5)
