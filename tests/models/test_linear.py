"""models/linear.py: the few-rows CPU path computes what F.linear computes (to rounding), with
and without bias, for every row count; more rows (and bfloat16) run oneDNN over a reordered
weight, reordered again when the weight changes; training takes F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.models.linear import ONEDNN, SMALL_ROWS, Linear


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


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_rows_run_on_the_reordered_weight_and_match_f_linear(dtype):
    torch.manual_seed(2)
    layer = Linear(96, 160, bias=True).to(dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    with torch.inference_mode():
        for shape in [(SMALL_ROWS + 1, 96), (32, 96), (257, 96), (2, 5, 96)]:
            x = torch.randn(shape, dtype=dtype)
            want = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), want, **tolerance)
    assert layer._packed is not None and layer._packed.is_mkldnn  # noqa: SLF001


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")
def test_a_changed_weight_is_reordered_again_and_training_takes_f_linear():
    torch.manual_seed(3)
    layer = Linear(64, 48, bias=False)
    x = torch.randn(16, 64)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # in place: a new version of the same storage
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(48, 64))  # new storage
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    out = layer(x)  # grad enabled, weight requires grad: F.linear, so backward works
    assert torch.equal(out, F.linear(x, layer.weight))
    out.sum().backward()
    assert layer.weight.grad is not None
