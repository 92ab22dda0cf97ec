"""The holder's side of a peer pull (docs/design.md, "Peer pull"): worker X pushes a prefix it
caches into the reservation worker Y opened for it, with the KV sender a prefill worker uses.

The blocks are pinned on X's engine thread (references taken, host and disk blocks brought
back as a local hit would) so nothing evicts them while the sender reads them on its own
thread, and unpinned however the push ends. X checks the prefix by walking its own cache with
the prompt's tokens, so a hash that matches on other tokens is never sent. A prefix X no
longer holds whole is refused, not sent in part, and the refusal aborts Y's transfer so Y
falls back at once instead of at the deadline.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from pdserve import metrics

if TYPE_CHECKING:
    from kv_transfer.base import KVSender, TransferResult
    from pdserve.worker.worker_runtime import WorkerRuntime


class PrefixNotHeld(Exception):
    """The holder no longer caches the whole prefix (evicted since the router looked): the
    pull's FAILED_PRECONDITION. The puller prefills instead."""


async def push_prefix(
    runtime: WorkerRuntime,
    sender: KVSender,
    request_id: str,
    prefix_token_ids: list[int],
    first_block: int,
    endpoint: str,
    transfer_id: str,
    deadline: float,
) -> TransferResult:
    """Pushes the cached blocks [first_block, len(prefix_token_ids) // block_size) of the
    prefix into Y's transfer `transfer_id` at `endpoint`, and commits them as a prefix, by
    `deadline` (unix time). Raises PrefixNotHeld, or KVTransferError when the send fails."""
    from kv_transfer.base import CommitInfo, KVTransferError, TransferRequest

    engine = runtime.engine
    push_id = f"push:{request_id}:{transfer_id[:8]}"
    block_ids = await runtime.loop.acall(lambda: engine.pin_prefix(push_id, prefix_token_ids))
    try:
        if block_ids is None or len(block_ids) <= first_block:
            await asyncio.to_thread(sender.abort, endpoint, transfer_id)
            raise PrefixNotHeld(
                f"{runtime.worker_id} no longer holds the {len(prefix_token_ids)}-token prefix "
                f"of request {request_id}"
            )
        left = deadline - time.time()
        if left <= 0:
            await asyncio.to_thread(sender.abort, endpoint, transfer_id)
            raise KVTransferError(f"the pull of request {request_id} is past its deadline")
        request = TransferRequest(
            endpoint=endpoint,
            transfer_id=transfer_id,
            src_block_ids=block_ids[first_block:],
            num_layers=engine.num_layers,
            read_kv=engine.read_kv,
            # A prefix commit carries no token: Y's reservation, opened for a pull, says how
            # it reads the commit (decode_service/handoffs.py).
            commit=CommitInfo(first_token_id=0, num_prompt_tokens=len(prefix_token_ids)),
            timeout_s=left,
        )
        try:
            sent = await asyncio.to_thread(sender.send, request)
        except Exception as exc:
            runtime.record_transfer(
                0, 0.0, failed=True, reason=metrics.transfer_failure_reason(exc)
            )
            await asyncio.to_thread(sender.abort, endpoint, transfer_id)
            raise
        runtime.record_transfer(sent.bytes, sent.seconds)
        return sent
    finally:
        await runtime.loop.acall(lambda: engine.unpin_prefix(push_id))
