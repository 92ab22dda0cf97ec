"""Workers' load snapshots as numpy vectors, one element per worker, for the option matrix
(router/option_matrix.py): what the cost policy reads of each worker, read once per decision."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from router.estimates import RoutingRequest, WorkerLoad
from router.load_rows import NUMBERS, LoadRows


class WorkerVectors:
    """Workers' load snapshots as integer vectors (one element per worker, in order)."""

    def __init__(self, workers: Sequence[WorkerLoad], cached: dict[str, int], full: int) -> None:
        n = len(workers)
        table = np.empty((1 + NUMBERS, n), dtype=np.int64)
        table[0] = np.fromiter((cached.get(w.worker_id, 0) for w in workers), np.int64, n)
        np.minimum(table[0], full, out=table[0])
        numbers = chain.from_iterable(w.numbers for w in workers)
        table[1:] = np.fromiter(numbers, np.int64, NUMBERS * n).reshape(n, NUMBERS).T
        self._set(table)

    @classmethod
    def of(
        cls,
        prefill: Sequence[WorkerLoad],
        decode: Sequence[WorkerLoad],
        cached: dict[str, int],
        full: int,
    ) -> WorkerVectors:
        """The prefill workers, then the decode workers. From the router's LoadRows their
        numbers are copied as arrays and only the workers holding a prefix are looked at;
        other sequences are read worker by worker."""
        parts = [rows for rows in (prefill, decode) if len(rows)]
        if not all(isinstance(rows, LoadRows) for rows in parts):
            return cls([*prefill, *decode], cached, full)
        table = np.empty((1 + NUMBERS, sum(map(len, parts))), dtype=np.int64)
        np.concatenate([rows.numbers for rows in parts], axis=1, out=table[1:])
        held, blocks, offset = [], [], 0
        for rows in parts:
            position = rows.position
            for worker_id, n in cached.items():
                at = position.get(worker_id)
                if at is not None:
                    held.append(offset + at)
                    blocks.append(n)
            offset += len(rows)
        table[0] = 0
        table[0, held] = np.minimum(blocks, full)
        out = cls.__new__(cls)
        out._set(table)
        return out

    def _set(self, table: np.ndarray) -> None:
        self._table = table
        self.cached, self.running, self.queued_requests, self.queued_tokens = table[:4]
        self.num_blocks, self.free, self.load, self.hybrid = table[4:8]
        self.evictable, self.hits, self.queries, self.inflight_blocks, self.recent = table[8:]

    def rows(self, part: slice) -> WorkerVectors:
        """The workers in `part` (views of these vectors)."""
        out = WorkerVectors.__new__(WorkerVectors)
        out._set(self._table[:, part])
        return out


def uncached_tokens(request: RoutingRequest, cached_blocks: np.ndarray) -> np.ndarray:
    """RoutingRequest.uncached_tokens over a vector of cached prefixes."""
    cached = np.minimum(cached_blocks, request.full_blocks) * request.block_size
    return np.maximum(1, request.prompt_tokens - cached)


def max_of_others(values: np.ndarray) -> np.ndarray:
    """Per element, the largest of the other elements (0 when there is none)."""
    if len(values) < 2:
        return np.zeros_like(values)
    top = int(np.argmax(values))
    out = np.full_like(values, values[top])
    out[top] = np.max(np.delete(values, top))
    return out
