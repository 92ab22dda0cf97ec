"""The nixl transport's descriptors: block runs merged per (layer, K|V) plane, a head subset
of blocks one descriptor per position (a tensor-parallel rank's part), and their checksum,
against the KV they must describe. Plain numpy and torch, no NIXL needed."""

from __future__ import annotations

import crc32c
import numpy as np
import torch

from kv_transfer import wire
from kv_transfer.nixl_agent import block_runs, position_regions, regions_checksum, run_regions
from kv_transfer.nixl_sender import source_rows
from tests.kv_transfer.kv_helpers import NUM_LAYERS, make_cache


def region_bytes(cache: torch.Tensor, rows: np.ndarray) -> bytes:
    flat = wire.tensor_bytes(cache)
    base = cache.data_ptr()
    return b"".join(bytes(flat[a - base : a - base + n]) for a, n, _ in rows.tolist())


def test_runs_break_where_either_side_stops_being_consecutive():
    dest_starts, src_starts, lengths = block_runs([5, 6, 7, 8, 12], [2, 3, 4, 9, 10])
    assert dest_starts.tolist() == [5, 8, 12]
    assert src_starts.tolist() == [2, 9, 10]
    assert lengths.tolist() == [3, 1, 1]
    assert [r.tolist() for r in block_runs([], [])] == [[], [], []]


def test_consecutive_blocks_are_one_descriptor_per_plane_covering_exactly_their_kv():
    cache = make_cache(1)
    ids = list(range(3, 11))
    starts, _, lengths = block_runs(ids, ids)
    planes = range(2 * NUM_LAYERS)
    block_bytes = cache[0, 0, 0].nbytes
    rows = run_regions(cache.data_ptr(), 0, cache.shape[2], planes, starts, lengths, block_bytes)
    assert len(rows) == 2 * NUM_LAYERS  # not 2 * NUM_LAYERS * 8
    assert region_bytes(cache, rows) == cache[:, :, ids].contiguous().numpy().tobytes()


def test_scattered_blocks_describe_the_kv_in_reservation_order_with_its_checksum():
    cache = make_cache(2, torch.bfloat16)
    src = [9, 10, 0, 15, 4, 5]
    starts, _, lengths = block_runs(src, src)
    block_bytes = cache[0, 0, 0].nbytes
    layers = range(2 * 1, 2 * 3)  # layers 1 and 2 only
    rows = run_regions(cache.data_ptr(), 0, cache.shape[2], layers, starts, lengths, block_bytes)
    assert len(rows) == 4 * 4  # 4 planes x 4 runs: [9,10], [0], [15], [4,5]
    expected = cache[1:3, :, src].contiguous()
    assert region_bytes(cache, rows) == wire.tensor_bytes(expected).tobytes()
    whole = crc32c.crc32c(wire.tensor_bytes(expected))
    assert regions_checksum(cache, rows) == whole
    # continued over two halves, as the receiver takes it a layer range at a time
    assert regions_checksum(cache, rows[8:], regions_checksum(cache, rows[:8])) == whole


def test_a_head_subset_is_one_descriptor_per_position_covering_exactly_those_heads():
    cache = torch.randn(2, 2, 6, 4, 4, 8, generator=torch.Generator().manual_seed(3))
    src = [4, 1, 2]
    head_bytes = cache[0, 0, 0, 0, 0].nbytes
    rows = position_regions(
        cache.data_ptr(), 0, cache.shape[2], range(4), np.asarray(src), cache.shape[3],
        4 * head_bytes, (1, 3), head_bytes,
    )  # fmt: skip
    assert len(rows) == 4 * len(src) * 4  # planes x blocks x positions
    assert set(rows[:, 1].tolist()) == {2 * head_bytes}  # heads 1 and 2, not the other two
    expected = cache[:, :, src, :, 1:3].contiguous()
    assert region_bytes(cache, rows) == wire.tensor_bytes(expected).tobytes()
    # The sender's checksum regions: per position for a subset, runs of blocks for every head.
    assert (source_rows(cache, src, (1, 3)) == rows).all()
    assert len(source_rows(cache, src, (0, 4))) == 4 * 2  # runs [4], [1, 2]
    whole = wire.tensor_bytes(cache[:, :, src].contiguous()).tobytes()
    assert region_bytes(cache, source_rows(cache, src, (0, 4))) == whole
