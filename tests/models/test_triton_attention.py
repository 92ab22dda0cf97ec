"""The GPU decode-attention kernel (pdserve/models/triton_attention.py), checked on the CPU by
Triton's interpreter: the same attention as SDPA over each sequence's gathered context, for
grouped and ungrouped heads, contexts of one token to several partitions, float32 and
bfloat16, with and without the store of each sequence's newest key and value. On a GPU,
`pdserve selftest --device cuda` checks the engine's tokens through it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.models import triton_attention
from pdserve.models.attention import reads_in_place
from tests.models.test_native_attention import enabled_when_switched_off

pytest.importorskip("triton", reason="the test extras install Triton (pyproject.toml)")

# (batch, heads, kv_heads, dim, block_size, table width in blocks). Tiles are TILE_TOKENS keys;
# under the interpreter the contexts are cut into partitions for INTERPRETER_PROGRAMS programs:
# from one partition of one tile to four of three, the last partly or wholly unused.
SHAPES = [
    (1, 8, 2, 64, 16, 3),  # one tile, one partition
    (4, 12, 4, 64, 16, 40),  # 3 query heads per KV head, 10 tiles in 4 partitions
    (5, 8, 8, 32, 4, 17),  # no grouped-query sharing, 2 tiles of 16 blocks, 2 partitions
    (2, 4, 1, 128, 8, 20),  # one KV head, 3 partitions of a tile
    (1, 4, 1, 16, 128, 2),  # 128-token blocks (a tile each), the smallest head size
]


def check_against_sdpa(device: str = "cpu") -> None:
    """On the CPU, run under TRITON_INTERPRET=1 (a subprocess of the test): Triton reads it when
    the kernels are defined, on first use. On a GPU: `python -c "from
    tests.models.test_triton_attention import check_against_sdpa as c; c('cuda')"`."""
    from tests.models.test_native_attention import _reference

    if os.environ.get("TRITON_INTERPRET") == "1":
        _interpret_bfloat16_dots()
    for dtype in (torch.float32, torch.bfloat16):
        for batch, heads, kv_heads, dim, block_size, width in SHAPES:
            gen = torch.Generator().manual_seed(batch * dim + width)
            num_blocks = batch * width + 3
            cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
            cache = cache.to(dtype)
            tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, -1)
            lens = torch.randint(1, width * block_size + 1, (batch,), generator=gen)
            lens[0] = width * block_size  # a full table
            lens[-1] = 1 if batch > 1 else lens[-1]  # a one-token context
            q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
            on = [x.to(device) for x in (q, cache, tables, lens)]
            out = triton_attention.paged_decode_attention(*on).cpu()
            assert out.shape == (batch, heads * dim) and out.dtype == dtype
            tolerance = (
                {"atol": 1e-5, "rtol": 1e-5}
                if dtype == torch.float32
                else {"atol": 2e-2, "rtol": 2e-2}
            )
            torch.testing.assert_close(
                out.view(batch, heads, dim).float(), _reference(q, cache, tables, lens), **tolerance
            )
            # Storing as it attends: each sequence's newest key and value given as strided
            # views of one fused qkv row (as the model's split makes them), q a view too.
            qkv = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
            q_view, k_new, v_new = qkv.split((heads, kv_heads, kv_heads), dim=1)
            newest = lens - 1
            slots = tables[torch.arange(batch), newest // block_size] * block_size
            slots += newest % block_size
            stored = cache.clone()
            stored.view(2, -1, kv_heads, dim)[0, slots] = k_new
            stored.view(2, -1, kv_heads, dim)[1, slots] = v_new
            cache_on = cache.to(device)
            new_kv = tuple(x.to(device) for x in (k_new, v_new, slots))
            out = triton_attention.paged_decode_attention(
                q_view.to(device), cache_on, *on[2:], new_kv
            ).cpu()
            assert torch.equal(cache_on.cpu(), stored)
            torch.testing.assert_close(
                out.view(batch, heads, dim).float(),
                _reference(q_view, stored, tables, lens),
                **tolerance,
            )
    print("ok")


def _interpret_bfloat16_dots() -> None:
    """Triton's interpreter (3.9) keeps bfloat16 as its uint16 bits and `tl.dot` multiplies those
    bits as integers (it converts only 8-bit floats first). Widen them to float32, which holds
    every bfloat16 exactly, so that the kernel checked is the kernel a GPU runs."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = dot


def test_the_kernel_equals_sdpa_over_the_gathered_context():
    code = "from tests.models.test_triton_attention import check_against_sdpa as c; c()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_gpus_read_in_place_where_triton_can_shape_the_blocks():
    cuda = torch.device("cuda")
    assert reads_in_place(cuda, head_dim=128, block_size=16)
    assert not reads_in_place(cuda, head_dim=80, block_size=16)  # not a power of two
    assert not reads_in_place(cuda, head_dim=64, block_size=12)
    assert not reads_in_place(torch.device("meta"), head_dim=64, block_size=16)


def test_switched_off_by_the_environment():
    assert enabled_when_switched_off(triton_attention) == "False"
