"""The GPU decode-attention kernel that reads the paged KV cache in place (Triton), the CUDA
counterpart of the CPU kernel in native_attention.py.

Without it a decode step gathers every sequence's whole (padded) context out of the pool each
layer before SDPA reads it: on an H100 that gather was 46% of a compiled batch-32 step of the
Llama-3.1-8B shape at 1024-token contexts, against 25% for the weight matmuls (BENCHMARKS.md,
"Fifth lease"). Here each program walks one sequence's tokens through its block table for one
KV head and its G query heads, reading each key and value row once, where it lies.

Each iteration reads a tile of TILE_TOKENS keys and values (several blocks: each row's address
comes from its block's table entry) and multiplies them on the tensor cores (`tl.dot`), the G
query heads padded to the 16 rows a tensor-core multiply needs. Decode attention is bound by
reading the cache; the first version, one block per iteration with elementwise products, read it
at ~0.6 TB/s on an H100.

Flash-decoding split: a context is cut into partitions of whole tiles, each a program of its
own, and a second kernel combines the partitions' softmax statistics. The partition count is
chosen from the batch: about PROGRAMS_PER_MULTIPROCESSOR programs per multiprocessor (a small
batch's long contexts are spread over the GPU), no more (each partition's partial output is
written and read back), and never a partition shorter than a tile.
Accumulation is in float32 whatever the cache's dtype.

Runs wherever Triton runs: CUDA, and the CPU through Triton's interpreter (TRITON_INTERPRET=1,
how tests check it on machines without a GPU). `PDSERVE_TRITON_ATTENTION=0` turns it off (the
gather path runs).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import Any, NamedTuple

import torch

DISABLE_ENV = "PDSERVE_TRITON_ATTENTION"
# Keys per iteration: four 16-token blocks, a [64, head_dim] tile for the tensor cores.
TILE_TOKENS = 64
# Rows of a tensor-core multiply: the query heads of one KV head are padded to at least this.
DOT_ROWS = 16
# Programs per multiprocessor that the partitions aim for (on CUDA; the interpreter takes
# INTERPRETER_PROGRAMS, so that the tests' small shapes are split too).
PROGRAMS_PER_MULTIPROCESSOR = 4
INTERPRETER_PROGRAMS = 64


@functools.cache
def enabled() -> bool:
    """Whether decode attention on CUDA reads the KV cache in place: Triton is installed and
    PDSERVE_TRITON_ATTENTION is not 0."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    return importlib.util.find_spec("triton") is not None


def supports(head_dim: int, block_size: int) -> bool:
    """Triton's block shapes are powers of two, and a tensor-core multiply's inner size is at
    least 16."""
    return _power_of_two(head_dim) and head_dim >= 16 and _power_of_two(block_size)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query per sequence (rope applied)
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [B, W] int64
    context_lens: torch.Tensor,  # [B] int64, >= 1: sequence b attends over its first slots
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [B, H * D]
    """Attention of each sequence's query over its context, read in place.

    With `new_kv` = (k, v, slots) (k, v: [B, KV, D], slots: [B] int64), each sequence's newest
    token (the last of its context) is this step's: the kernel writes its key and value into
    slot `slots[b]` and attends over them as computed, so a decode step stores and attends in
    one launch instead of two index copies and this kernel (attention.store_kv). q, k and v may
    be strided views (the fused qkv output's heads) as long as their last dimension is dense."""
    kernels = _kernels()
    gpu = _gpu(q.device)
    batch, heads, dim = q.shape
    _, _, block_size, kv_heads, _ = layer_cache.shape
    group = heads // kv_heads
    group_pad = max(DOT_ROWS, _next_power_of_two(group))
    tile = max(TILE_TOKENS, block_size)
    # The table's width, not the longest context, bounds the partitions, so a compiled step
    # (static tables) launches the same grid every time. Both numbers are launch-time values,
    # not compiled into the kernels: an eager step's table width grows with its longest context,
    # and each new constant would compile a kernel in the middle of serving (the merge compiles
    # once per power of two of the partition count).
    tiles = max(1, -(-block_tables.shape[1] * block_size // tile))
    wanted = -(-_programs_wanted(gpu) // (batch * kv_heads))
    partition_tiles = -(-tiles // max(1, min(tiles, wanted)))
    splits = -(-tiles // partition_tiles)
    if q.stride(2) != 1:
        q = q.contiguous()
    store = new_kv is not None
    k_new, v_new, slots = new_kv if store else (q, q, context_lens)  # unread without a store
    if store:
        k_new, v_new = (x if x.stride(2) == 1 else x.contiguous() for x in (k_new, v_new))
    tables = block_tables.contiguous()
    partial = torch.empty(batch, kv_heads, splits, group, dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, batch, kv_heads, splits, group, dtype=torch.float32, device=q.device)
    keys, values = layer_cache[0], layer_cache[1]
    kernels.partition[(batch, kv_heads, splits)](
        q,
        keys,
        values,
        tables,
        context_lens,
        k_new,
        v_new,
        slots,
        partial,
        stats[0],
        stats[1],
        tables.shape[1],
        partition_tiles,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        1.0 / math.sqrt(dim),
        HEADS=heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        DIM=dim,
        BLOCK_SIZE=block_size,
        TILE=tile,
        STORE=store,
        PRECISION=_float32_precision(gpu) if keys.dtype == torch.float32 else "tf32",
    )
    out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    kernels.combine[(batch, heads)](
        partial,
        stats[0],
        stats[1],
        out,
        splits,
        KV_HEADS=kv_heads,
        GROUP=group,
        DIM=dim,
        SPLITS_PAD=_next_power_of_two(splits),
    )
    return out


def _gpu(device: torch.device) -> Any:
    """The properties of CUDA `device`; None elsewhere (Triton's interpreter on the CPU)."""
    if device.type != "cuda":
        return None
    return _properties(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _properties(index: int) -> Any:
    return torch.cuda.get_device_properties(index)


def _programs_wanted(gpu: Any) -> int:
    if gpu is None:
        return INTERPRETER_PROGRAMS
    return PROGRAMS_PER_MULTIPROCESSOR * gpu.multi_processor_count


def _float32_precision(gpu: Any) -> str:
    """How float32 caches multiply: at about float32's precision on the tensor cores, as three
    TF32 products of high and low halves (one would lose it), where the GPU has TF32 (compute
    capability 8.0 on); "ieee" multiplies on the CUDA cores, 8x slower in the 8B shape's
    float32 step on an H100 (BENCHMARKS.md, "Ninth lease"). 16-bit caches ignore it. Triton's
    interpreter multiplies in float32 either way."""
    if gpu is None or (gpu.major, gpu.minor) >= (8, 0):
        return "tf32x3"
    return "ieee"


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Kernels(NamedTuple):
    partition: Any  # triton.JITFunction
    combine: Any


@functools.cache
def _kernels() -> _Kernels:
    """The jitted kernels, made on first use: Triton reads TRITON_INTERPRET when a kernel is
    defined, and importing triton is not free."""
    import triton
    import triton.language as tl

    @triton.jit
    def partition(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        k_new_ptr,
        v_new_ptr,
        slots_ptr,
        acc_ptr,
        max_ptr,
        sum_ptr,
        table_width,
        partition_tiles,
        stride_block,
        stride_slot,
        stride_head,
        stride_q_seq,
        stride_q_head,
        stride_k_seq,
        stride_k_head,
        stride_v_seq,
        stride_v_head,
        scale,
        HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        STORE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # One program: sequence b, KV head h, partition s of its tiles. Writes the partition's
        # unnormalised output [GROUP, DIM], its running maximum and its sum of exponentials.
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        splits = tl.num_programs(2)
        context = tl.load(lens_ptr + b)
        first = s * partition_tiles
        last = tl.minimum(first + partition_tiles, tl.cdiv(context, TILE))
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM)
        t = tl.arange(0, TILE)
        rows = g < GROUP
        q_rows = q_ptr + b * stride_q_seq + (h * GROUP + g)[:, None] * stride_q_head + d[None, :]
        q = tl.load(q_rows, mask=rows[:, None], other=0.0).to(k_ptr.dtype.element_ty)
        if STORE:
            # The newest token's key and value, used as computed: its slot is read stale and
            # replaced in the tile, and written by the partition that holds it at the end.
            newest = context - 1
            k_last = tl.load(k_new_ptr + b * stride_k_seq + h * stride_k_head + d)
            v_last = tl.load(v_new_ptr + b * stride_v_seq + h * stride_v_head + d)
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        for i in range(first, last):
            token = i * TILE + t
            valid = token < context
            # Each row's block from the table; rows past the context read nothing (their
            # slots may hold anything, NaN included).
            block = tl.load(tables_ptr + b * table_width + token // BLOCK_SIZE, mask=valid, other=0)
            rows_at = block * stride_block + (token % BLOCK_SIZE) * stride_slot + h * stride_head
            offsets = rows_at[:, None] + d[None, :]
            k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)  # [TILE, DIM]
            v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
            if STORE:
                is_newest = (token == newest)[:, None]
                k = tl.where(is_newest, k_last[None, :], k)
                v = tl.where(is_newest, v_last[None, :], v)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, TILE]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(p, axis=1)
            weighted = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * correction[:, None] + weighted
            running_max = new_max
        at = (b * kv_heads + h) * splits + s
        tl.store(acc_ptr + (at * GROUP + g)[:, None] * DIM + d[None, :], acc, mask=rows[:, None])
        tl.store(max_ptr + at * GROUP + g, running_max, mask=rows)
        tl.store(sum_ptr + at * GROUP + g, running_sum, mask=rows)
        # Nested: `newest` exists only when STORE, a compile-time constant (as run on the GPU).
        if STORE:  # noqa: SIM102
            if newest // TILE // partition_tiles == s:
                slot = tl.load(slots_ptr + b)
                to = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
                tl.store(k_ptr + to + h * stride_head + d, k_last)
                tl.store(v_ptr + to + h * stride_head + d, v_last)

    @triton.jit
    def combine(
        acc_ptr,
        max_ptr,
        sum_ptr,
        out_ptr,
        splits,
        KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        DIM: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        # One program: sequence b, query head `head`. Rescales each partition to the global maximum.
        # Partition 0 always holds a key (context >= 1); an empty one has maximum -inf, weight 0.
        b = tl.program_id(0)
        head = tl.program_id(1)
        h = head // GROUP
        g = head % GROUP
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, DIM)
        valid = s < splits
        at = (b * KV_HEADS + h) * splits + s
        maxima = tl.load(max_ptr + at * GROUP + g, mask=valid, other=float("-inf"))
        sums = tl.load(sum_ptr + at * GROUP + g, mask=valid, other=0.0)
        top = tl.max(maxima, axis=0)
        weights = tl.where(maxima > float("-inf"), tl.exp(maxima - top), 0.0)
        parts = tl.load(
            acc_ptr + (at * GROUP + g)[:, None] * DIM + d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        total = tl.sum(sums * weights, axis=0)
        out = tl.sum(parts * weights[:, None], axis=0) / total
        heads = KV_HEADS * GROUP
        tl.store(out_ptr + (b * heads + head) * DIM + d, out.to(out_ptr.dtype.element_ty))

    return _Kernels(partition, combine)
