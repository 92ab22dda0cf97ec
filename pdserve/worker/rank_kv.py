"""The KV transport of rank r > 0 of a tensor-parallel worker (kv_transfer/tp_handoff.py).

A decode rank serves a KV endpoint of its own and receives its heads there, straight from the
prefill ranks that hold them; rank 0 opens, seals and aborts this rank's part of each handoff
(`call`) with its own, over Ray. A prefill rank pushes its heads when rank 0 asks (`push`).
Either way the bytes never pass through rank 0. Rank 0's side is in the role actors
(decode_service/worker.py, prefill_service/worker.py) over RankGroup's calls.
"""

from __future__ import annotations

from typing import Any

from kv_transfer.base import CommitInfo, KVLayout, TransferResult
from kv_transfer.factory import make_receiver, make_sender
from kv_transfer.tp_handoff import SlicedSend, push_own_heads
from pdserve.config import KVTransferConfig
from pdserve.models.llama import shard_layout
from pdserve.models.tensor_parallel import TensorParallel

# What rank 0 may call on this rank's receiver (tp_handoff.FollowerCalls; open_transfer_ids: stats).
RECEIVER_CALLS = ("open", "seal", "abort", "open_transfer_ids")


class _RankSink:
    """Writes this rank's heads into its cache. Commits and freeing blocks are rank 0's: its
    block manager owns the blocks, and it fences this rank before freeing them."""

    def __init__(self, executor: Any, rank: int) -> None:
        self._executor = executor
        self._rank = rank

    def write_kv(
        self, transfer_id: str, block_ids: list[int], layer_start: int, data: Any, head_start: int
    ) -> None:
        self._executor.write_kv(block_ids, layer_start, data, head_start)

    def on_commit(self, transfer_id: str, commit: CommitInfo) -> None:
        raise RuntimeError(
            f"rank {self._rank} of a tensor-parallel decode worker takes no commit: "
            "commit on rank 0's KV endpoint"
        )

    def on_expired(self, transfer_id: str) -> None:
        """Nothing to free here: rank 0 frees the blocks of every rank."""


class RankKV:
    def __init__(
        self, role: str, config: KVTransferConfig, executor: Any, tp: TensorParallel
    ) -> None:
        self.rank = tp.rank
        self._kv_cache = executor.kv_cache
        self.endpoint = ""
        self._receiver = self._sender = None
        if role == "decode":
            first_head = shard_layout(executor.model.config, tp).first_kv_head
            layout = KVLayout.of(self._kv_cache, first_head)
            sink = _RankSink(executor, tp.rank)
            self._receiver = make_receiver(config, sink, layout, self._kv_cache)
            self.endpoint = self._receiver.start()
        else:
            self._sender = make_sender(config, self._kv_cache)

    def call(self, method: str, *args: Any) -> Any:
        """Rank 0's open / seal / abort of this rank's part of a handoff."""
        if method not in RECEIVER_CALLS or self._receiver is None:
            raise ValueError(f"{method!r} is not a decode rank's receiver call {RECEIVER_CALLS}")
        return getattr(self._receiver, method)(*args)

    def push(self, send: SlicedSend) -> TransferResult:
        """Pushes this prefill rank's heads of a handoff (rank 0 commits)."""
        return push_own_heads(self._sender, send, self.rank, self._kv_cache)
