"""The CPU decode-attention kernel that reads the paged KV cache in place
(pdserve/models/native_attention.py): the same attention as SDPA over each sequence's gathered
context, alone and in a step, and bad input refused (tests/engine/test_kv_read_in_place.py: the
engine's tokens)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.gpu_step.attention_batch import attention_context
from pdserve.models import native_attention
from pdserve.models.attention import paged_attention
from tests.models.test_length_groups import random_step

pytestmark = pytest.mark.skipif(
    os.environ.get(native_attention.DISABLE_ENV) == "0", reason="switched off for this run"
)


def test_the_kernel_builds_here():
    """CI has g++ and ninja: a failed build must fail here, not fall back unnoticed."""
    assert native_attention.enabled()


def _reference(q, cache, tables, lens):
    """SDPA of each sequence's query over its gathered context, in float32: [B, H, D]."""
    heads, kv_heads, dim = q.shape[1], cache.shape[3], q.shape[2]
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        k, v = (cache[i][tables[b]].reshape(-1, kv_heads, dim)[:n].float() for i in (0, 1))
        k, v = (x.transpose(0, 1).repeat_interleave(heads // kv_heads, 0) for x in (k, v))
        out.append(F.scaled_dot_product_attention(q[b].float()[:, None], k, v)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "dim", "block_size", "max_blocks"),
    [
        (1, 8, 4, 64, 16, 3),  # one sequence: the heads are split between threads
        (32, 8, 4, 64, 16, 4),  # a decode batch: one task per sequence
        (5, 8, 8, 32, 4, 7),  # no grouped-query sharing
        (3, 12, 2, 128, 16, 2),
        (2, 4, 1, 64, 8, 20),  # one KV head, long contexts
    ],
)
def test_the_kernel_equals_sdpa_over_the_gathered_context(
    dtype, batch, heads, kv_heads, dim, block_size, max_blocks
):
    assert native_attention.enabled()
    gen = torch.Generator().manual_seed(batch * dim + max_blocks)
    num_blocks = batch * max_blocks + 5
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, -1)
    lens = torch.randint(1, max_blocks * block_size + 1, (batch,), generator=gen)
    lens[0] = max_blocks * block_size  # a full table, and
    lens[-1] = 1 if batch > 1 else lens[-1]  # a one-token context
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    out = native_attention.paged_decode_attention(q, cache, tables, lens)
    assert out.shape == (batch, heads * dim) and out.dtype == dtype
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(
        out.view(batch, heads, dim).float(), _reference(q, cache, tables, lens), **tolerance
    )


@pytest.mark.parametrize(
    ("lasts", "lens"),
    [
        ([1, 40, 2, 37], [1, 1, 1, 1]),  # decode only: the whole batch is read in place
        ([1, 30, 2, 20], [1, 1, 1, 6]),  # decode rows beside a prefill chunk
        ([0, 3, 40, 44], [3, 1, 5, 1]),  # two chunks, two decode rows
        ([5, 9], [6, 4]),  # no decode row: nothing to read in place
    ],
)
def test_a_step_read_in_place_equals_the_gathered_step(lasts, lens):
    cache, starts, tables, slots, block_size, (q, k, v) = random_step(lasts, lens)
    cpu = torch.device("cpu")
    gathered = attention_context(starts, lens, tables, slots, block_size, cpu)
    in_place = attention_context(starts, lens, tables, slots, block_size, cpu, in_place=True)
    decode_rows = [i for i, n in enumerate(lens) if n == 1]
    if len(decode_rows) == len(lens):
        assert in_place.groups is None and in_place.context_lens.tolist() == [s + 1 for s in starts]
    else:
        assert in_place.context_lens is None
        read = [g for g in in_place.groups or [] if g.context_lens is not None]
        assert [g.out_rows.tolist() for g in read] == (
            [[sum(lens[:i]) for i in decode_rows]] if decode_rows else []
        )
        # Read in place, they need no mask or query index (nothing would read them).
        assert all(g.attn_mask is None and g.query_index is None for g in read)
        assert [g.context_lens.tolist() for g in read] == (
            [[starts[i] + 1 for i in decode_rows]] if decode_rows else []
        )
    expected = paged_attention(q, k, v, cache.clone(), gathered)
    torch.testing.assert_close(paged_attention(q, k, v, cache.clone(), in_place), expected)
    assert gathered.context_lens is None
    assert all(g.context_lens is None for g in gathered.groups or [])


def test_bad_input_is_an_error_not_a_stray_read():
    assert native_attention.enabled()
    cache = torch.randn(2, 4, 4, 2, 8)
    q = torch.randn(1, 4, 8)
    ok_table, ok_len = torch.tensor([[0, 1]]), torch.tensor([8])
    native_attention.paged_decode_attention(q, cache, ok_table, ok_len)
    bad = [
        (q, cache, torch.tensor([[0, 9]]), ok_len, "outside the cache"),
        (q, cache, ok_table, torch.tensor([9]), "outside its block table"),
        (q, cache, ok_table, torch.tensor([0]), "outside its block table"),
        (q.double(), cache, ok_table, ok_len, "dtypes differ"),
        (torch.randn(1, 3, 8), cache, ok_table, ok_len, "multiple of kv_heads"),
        (q, cache, ok_table.int(), ok_len, "int64"),
    ]
    for args in bad:
        with pytest.raises(RuntimeError, match=args[-1]):
            native_attention.paged_decode_attention(*args[:-1])


def enabled_when_switched_off(module) -> str:
    """What `module.enabled()` says in a new process with its DISABLE_ENV set to 0."""
    code = (
        f"from pdserve.models import {module.__name__.rsplit('.', 1)[1]} as m; print(m.enabled())"
    )
    env = {**os.environ, module.DISABLE_ENV: "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_switched_off_by_the_environment():
    assert enabled_when_switched_off(native_attention) == "False"
