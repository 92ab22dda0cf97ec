"""A tensor-parallel worker's executors: rank 0's `LeaderExecutor` (the engine's executor: the
one engine of the worker, with its scheduler, block manager and prefix cache, runs on rank 0)
and the other ranks' `follow` loop, which replays on its shard what rank 0 does to the model
and the KV cache's blocks.

A step's forward (whose row-parallel all-reduces and LM-head all-gather need every rank) and
a block copy are each one command broadcast from rank 0 over the worker's torch.distributed
group (Gloo on CPU, NCCL on CUDA), then the same work on every rank. KV handoffs are not
commands: each rank reads and writes its own heads' slice of a handoff over its own KV sender
or endpoint (kv_transfer/tp_handoff.py), so rank 0's `read_kv` / `write_kv` are its own
cache's, as any rank's. A step sends what `ModelRunner.run` reads of each sequence, not the sequences: the tokens of the
chunk, positions, block table, sampling parameters (DoLa/SLED exits) and draft count.
Sampling, beams and draft verification stay on rank 0 (every rank has the whole logits, only
rank 0 uses them).

The host KV tier (--kv-offload-gb) under TP: rank 0's HostTier decides what moves (its block
manager is the worker's), and each copy between a device block and a host slot is a command
too, broadcast as it is made, so every rank moves its own heads' slice of the block between its
own cache and its own host pool of the same slots. Broadcast at once rather than with the next
step: a block evicted for a reservation may be written by a rank's KV handoff before that step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.host_kv_pool import HostKVPool
from pdserve.engine.host_tier import HostTier
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.models.llama import shard_layout
from pdserve.models.tensor_parallel import TensorParallel


class _TokenWindow:
    """The tokens of one step's chunk, indexed as the whole sequence's token_ids would be
    (ModelRunner._prepare slices token_ids[start:end])."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, window: slice) -> list[int]:
        return self.ids[window.start - self.start : window.stop - self.start]


@dataclass
class _RankSeq:
    """What ModelRunner.run reads of one scheduled sequence."""

    num_computed_tokens: int
    num_tokens: int
    block_table: list[int]
    token_ids: _TokenWindow
    params: SamplingParams
    num_draft_tokens: int


def _rank_batch(batch: ScheduledBatch) -> ScheduledBatch:
    seqs = [
        _RankSeq(
            seq.num_computed_tokens,
            seq.num_tokens,
            list(seq.block_table),
            _TokenWindow(
                seq.num_computed_tokens,
                seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n],
            ),
            seq.params,
            seq.num_draft_tokens,
        )
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)
    ]
    return ScheduledBatch(seqs=seqs, num_tokens=list(batch.num_tokens))


def _broadcast(command: tuple | None) -> tuple:
    """Rank 0's command (given there, None elsewhere), on every rank."""
    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LeaderExecutor:
    """Rank 0's executor: a TorchExecutor on rank 0's shard whose steps and block copies are
    first broadcast to the other ranks. Steps run one at a time (no overlapped launch/collect:
    the next step's tokens would have to reach the other ranks before they are known). One
    command and its collectives at a time: `stop` comes from the shutting-down actor's thread."""

    overlaps_steps = False
    offers_beam_candidates = True

    def __init__(self, inner: Any, tp: TensorParallel) -> None:
        self._inner = inner
        self._tp = tp
        self._lock = threading.Lock()

    # model_config, kv_cache, model, runner, stats, and read_kv / write_kv of its own heads
    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def kv_heads(self) -> int:
        """The whole model's KV heads (each rank's cache holds its share)."""
        return shard_layout(self._inner.model.config, self._tp).total_kv_heads

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block over every head (what a transfer moves per block)."""
        local = self._inner.kv_cache.shape[-2]
        return self._inner.bytes_per_block // local * self.kv_heads

    def execute(self, batch: ScheduledBatch, step_started: float):
        with self._lock:
            _broadcast(("run", _rank_batch(batch)))
            return self._inner.execute(batch, step_started)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        with self._lock:
            _broadcast(("copy", copies))
            self._inner.copy_blocks(copies)

    def host_tier(self, budget_bytes: int) -> HostTier | None:
        """The worker's host tier: as many whole blocks (every head's bytes) as `budget_bytes`
        holds, each rank keeping its heads' share; None when not one fits."""
        slots = budget_bytes // self.bytes_per_block
        if not slots:
            return None
        with self._lock:
            _broadcast(("host_pool", slots))
            pool = HostKVPool(self._inner.kv_cache, slots)
        return HostTier(_ReplicatedHostPool(pool, self._lock), slots)

    def stop(self) -> None:
        """Ends the other ranks' follow loops."""
        with self._lock:
            _broadcast(("stop",))


class _ReplicatedHostPool:
    """host_tier.BlockCopier on rank 0: its own pool's copies, each first broadcast so that the
    other ranks make it on theirs. Without a disk tier (refused under TP): no host_block or
    load_from."""

    def __init__(self, pool: HostKVPool, lock: threading.Lock) -> None:
        self._pool = pool
        self._lock = lock
        self.bytes_per_s = pool.bytes_per_s

    def save(self, block_id: int, slot: int) -> None:
        with self._lock:
            _broadcast(("host_save", block_id, slot))
            self._pool.save(block_id, slot)

    def load(self, slot: int, block_id: int) -> None:
        with self._lock:
            _broadcast(("host_load", slot, block_id))
            self._pool.load(slot, block_id)

    def fence(self) -> None:
        self._pool.fence()  # each rank fences its own copies before its next command's work


def follow(executor: Any, tp: TensorParallel) -> None:
    """Rank tp.rank > 0: replays rank 0's commands on this rank's shard until rank 0 says stop
    (or its group breaks: the collective raises)."""
    pool: HostKVPool | None = None
    while True:
        command = _broadcast(None)
        op = command[0]
        if op == "stop":
            return
        if op == "host_pool":
            pool = HostKVPool(executor.kv_cache, command[1])
        elif op == "host_save":
            pool.save(command[1], command[2])
        elif op == "host_load":
            pool.load(command[1], command[2])
        else:
            if pool is not None:  # the copies before this command land before its work
                pool.fence()
            if op == "run":
                executor.runner.run(command[1])
            elif op == "copy":
                executor.copy_blocks(command[1])
