"""A real KV sink over a torch tensor, and small caches shaped like the engine's."""

from __future__ import annotations

import threading

import torch

from kv_transfer import CommitInfo

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 16, 4, 2, 8


def make_cache(seed: int | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, heads, head_dim]; random if seeded, else zeros."""
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reader(cache: torch.Tensor):
    """An engine-like read_kv over `cache` that also records which blocks were read."""
    reads: list[list[int]] = []

    def read_kv(block_ids: list[int], layer_start: int, layer_end: int) -> torch.Tensor:
        reads.append(list(block_ids))
        return cache[layer_start:layer_end, :, block_ids].contiguous()

    read_kv.reads = reads  # type: ignore[attr-defined]
    return read_kv


class TensorSink:
    """Writes received KV into a real cache tensor and records commits and expiries."""

    def __init__(self, cache: torch.Tensor, refuse_commit: bool = False) -> None:
        self.cache = cache
        self.refuse_commit = refuse_commit
        self.commits: dict[str, CommitInfo] = {}
        self.expired: list[str] = []
        self.writes = 0
        self.written_by: set[str] = set()  # transfer ids whose chunks were written
        self.changed = threading.Event()

    def write_kv(
        self,
        transfer_id: str,
        block_ids: list[int],
        layer_start: int,
        data: torch.Tensor,
        head_start: int,
    ) -> None:
        self.written_by.add(transfer_id)
        layers = slice(layer_start, layer_start + data.shape[0])
        heads = slice(head_start, head_start + data.shape[4])
        self.cache[layers, :, block_ids, :, heads] = data
        self.writes += 1

    def on_commit(self, transfer_id: str, commit: CommitInfo) -> None:
        if self.refuse_commit:
            raise RuntimeError("request was cancelled")
        self.commits[transfer_id] = commit
        self.changed.set()

    def on_expired(self, transfer_id: str) -> None:
        self.expired.append(transfer_id)
        self.changed.set()
