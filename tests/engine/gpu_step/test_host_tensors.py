"""host_tensors: the step inputs' int64 tensors equal torch.tensor's, without its per-element
conversion."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.gpu_step.host_tensors import int64_tensor, padded_rows

INT64 = st.integers(-(2**63), 2**63 - 1)


@given(st.lists(INT64, max_size=64))
def test_an_int64_tensor_equals_torch_tensor(values):
    got = int64_tensor(values)
    assert got.dtype == torch.int64 and got.shape == (len(values),)
    assert torch.equal(got, torch.tensor(values, dtype=torch.int64))


@given(
    st.lists(st.lists(st.integers(0, 2**31), max_size=12), min_size=1, max_size=8),
    st.integers(0, 10),
)
def test_rows_are_cut_or_padded_to_the_width(rows, width):
    expected = [row[:width] + [0] * (width - len(row[:width])) for row in rows]
    assert torch.equal(
        padded_rows(rows, width), torch.tensor(expected, dtype=torch.int64).view(len(rows), width)
    )


def test_an_int_outside_int64_is_refused():
    with pytest.raises(OverflowError):
        int64_tensor([2**63])
