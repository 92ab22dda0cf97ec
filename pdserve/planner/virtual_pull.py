"""A peer pull in the simulated cluster (--peer-pull), as router/peer_pull.py and the decode
workers run it (docs/design.md, "Peer pull"): Y reserves the prompt for the pull
(`reserve(pull=True)`), X pins its cached prefix, the blocks Y lacks cross the deployment's
link (`Deployment.push_seconds`: bytes / link bandwidth plus a push's fixed cost, as a
prefill handoff's push takes), then Y commits them as a prefix
and prefills the rest while X unpins. X records the push as a transfer, so the router's cost
model learns the link from pulls as it does from handoffs. When Y has no room for the pull, Y
prefills as usual; when it already holds the prefix, or X no longer holds it whole, Y falls
back to prefilling from its own hits, as the live decode worker does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import Reservation
from router.peer_pull import PeerPull

if TYPE_CHECKING:
    from pdserve.planner.cluster import VirtualCluster


def pull_and_prefill(
    cluster: VirtualCluster,
    work_id: str,
    prompt: Sequence[int],
    params: SamplingParams,
    decode_worker: str,
    pull: PeerPull,
) -> None:
    """Y (`decode_worker`) pulls the prompt's blocks up to `pull.pulled_blocks` from
    `pull.holder`, then prefills the rest; its outputs reach whoever listens on Y."""
    puller, holder = cluster.workers[decode_worker], cluster.workers[pull.holder]
    prefix = list(prompt[: pull.pulled_blocks * pull.block_size])
    push_id = f"push:{work_id}"

    def reserved(reservation: Reservation | None) -> None:
        if reservation is None:  # no room for the whole table now: a plain local prefill
            puller.call(lambda: puller.engine.add_request(work_id, prompt, params))
            return
        missing = [i for i in reservation.missing_block_indices if i < pull.pulled_blocks]
        if not missing:  # Y holds as much as X: nothing to pull
            puller.call(lambda: puller.engine.fall_back(work_id))
            return
        holder.call(lambda: holder.engine.pin_prefix(push_id, prefix), lambda b: pinned(b, missing))

    def pinned(block_ids: list[int] | None, missing: list[int]) -> None:
        if block_ids is None or len(block_ids) <= missing[0]:  # X lost it: Y prefills it
            holder.call(lambda: holder.engine.unpin_prefix(push_id))
            puller.call(lambda: puller.engine.fall_back(work_id))
            return
        num_bytes = len(missing) * holder.engine.bytes_per_block
        seconds = cluster.deployment.push_seconds(num_bytes)
        cluster.loop.after(seconds, lambda: pushed(num_bytes, seconds))

    def pushed(num_bytes: int, seconds: float) -> None:
        holder.record_transfer(num_bytes, seconds)

        def commit() -> None:
            puller.engine.commit_prefix(work_id, pull.pulled_blocks, True)

        puller.call(commit, lambda _: holder.call(lambda: holder.engine.unpin_prefix(push_id)))

    puller.call(lambda: puller.engine.reserve(work_id, prompt, params, pull=True), reserved)
