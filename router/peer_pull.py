"""Peer pull, the router's side (docs/design.md, "Peer pull"): whether a decode worker Y that
prefills a request itself should pull the prefix a longer holder X caches instead of
recomputing it, and running that pull.

The pull is one more way of the local option on Y: the policy prices it (router/estimates.py,
router/option_matrix.py, with `pull_seconds` and `PULL_MARGIN`) so that it prefers Y because
Y could pull, and `plan_pull` names the holder of the pull the chosen option priced. It pays
when the transfer of blocks [h_Y, h_X) beats computing their tokens with a margin against a
misfit line. X pushes while Y waits for the blocks; however the pull ends without them (X
refuses, dies, is marked unhealthy, is slow past the pull's deadline) Y prefills from its own
hits, so the request never fails for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdserve.core.messages import KVReservation, WorkRequest
from router.cost_model import CostModel

log = logging.getLogger(__name__)

# A pull is taken only when it costs less than this share of the recompute it saves.
PULL_MARGIN = 0.8
# The pull's deadline, as a multiple of its estimate: past it Y stops waiting and prefills.
# At least PULL_MIN_DEADLINE_S, so a line fitted on small pushes does not cut a large one.
PULL_DEADLINE_FACTOR = 10.0
PULL_MIN_DEADLINE_S = 1.0
# How often a running pull checks that its holder is still healthy.
_WATCH_INTERVAL_S = 0.05


@dataclass(frozen=True)
class PeerPull:
    """Y pulls the prompt's blocks [own_blocks, pulled_blocks) from `holder`."""

    holder: str
    own_blocks: int
    pulled_blocks: int
    block_size: int
    pull_s: float  # estimated: the handoff's round trips and the transfer
    recompute_s: float  # estimated: Y's prefill of the pulled blocks' tokens

    @property
    def deadline_s(self) -> float:
        """How long Y waits for the blocks before prefilling them itself."""
        return max(PULL_MIN_DEADLINE_S, PULL_DEADLINE_FACTOR * self.pull_s)


def pull_seconds(cost: CostModel, blocks: int, bytes_per_block: int) -> float:
    """The pull of `blocks` blocks: the handoff's round trips and the transfer, as fitted."""
    return cost.handoff_seconds() + cost.transfer_seconds(blocks * bytes_per_block)


def peer_blocks(
    decode_workers: Iterable[str],
    cached_blocks: Mapping[str, int],
    prompt_tokens: int,
    block_size: int,
) -> dict[str, int]:
    """Per decode worker, the longest prefix of the prompt another one of `decode_workers`
    holds, in blocks, capped below the last prompt token (the puller computes that one, for
    its logits): what that worker could pull."""
    limit = (prompt_tokens - 1) // block_size
    held = {w: min(cached_blocks.get(w, 0), limit) for w in decode_workers}
    ranked = sorted(held.values(), reverse=True)
    top, second = (ranked + [0, 0])[:2]
    return {w: second if blocks == top else top for w, blocks in held.items()}


def plan_pull(
    cost: CostModel,
    decode_worker: str,
    prompt_tokens: int,
    block_size: int,
    bytes_per_block: int,
    cached_blocks: Mapping[str, int],
    holders: Iterable[str],
) -> PeerPull | None:
    """The pull into `decode_worker` from the healthy `holders`' longest cached prefix of the
    prompt, if it beats recomputing those blocks there; None otherwise."""
    own = cached_blocks.get(decode_worker, 0)
    limit = (prompt_tokens - 1) // block_size  # the last prompt token is Y's to compute
    longest, holder = own, None
    for worker_id in holders:
        blocks = min(cached_blocks.get(worker_id, 0), limit)
        if worker_id != decode_worker and blocks > longest:
            longest, holder = blocks, worker_id
    if holder is None or not bytes_per_block:
        return None
    pull_s = pull_seconds(cost, longest - own, bytes_per_block)
    recompute_s = cost.prefill_seconds(
        prompt_tokens - own * block_size, local=True
    ) - cost.prefill_seconds(prompt_tokens - longest * block_size, local=True)
    if not pull_s < PULL_MARGIN * recompute_s:
        return None
    return PeerPull(holder, own, longest, block_size, pull_s, recompute_s)


async def start_pull(pool, work: WorkRequest, decode_worker: str, pull: PeerPull) -> bool:
    """Reserves the prompt on Y for the pull and has X push in the background; False when Y
    has no room now (the caller then prefills there as usual)."""
    decode = pool.workers[decode_worker].handle
    reservation = await decode.reserve_pull(work, pull.pulled_blocks, pull.deadline_s)
    if reservation is None:
        return False
    if reservation.missing_block_indices:  # else Y found the prefix itself and prefills
        task = asyncio.create_task(_push(pool, work, decode_worker, pull, reservation))
        _pushes.add(task)
        task.add_done_callback(_pushes.discard)
    return True


_pushes: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones


async def _push(
    pool, work: WorkRequest, decode_worker: str, pull: PeerPull, reservation: KVReservation
) -> None:
    """X pushes into Y's reservation; Y is told to fall back at once when X fails or is marked
    unhealthy meanwhile (else it would wait for the pull's deadline)."""
    holder = pool.workers[pull.holder]
    first = reservation.missing_block_indices[0]
    push = asyncio.ensure_future(
        holder.handle.push_prefix(
            work.request_id,
            list(work.prompt_token_ids[: pull.pulled_blocks * pull.block_size]),
            first,
            reservation.endpoint,
            reservation.transfer_id,
            time.time() + pull.deadline_s,
        )
    )
    try:
        while not push.done():
            if not holder.healthy:
                push.cancel()
                raise RuntimeError(f"holder {pull.holder} was marked unhealthy")
            await asyncio.wait({push}, timeout=_WATCH_INTERVAL_S)
        push.result()
    except Exception as exc:  # noqa: BLE001 (any failure of the pull ends in the fallback)
        log.info("pull of %s from %s failed (%s); prefilling", work.request_id, pull.holder, exc)
        with contextlib.suppress(Exception):
            await pool.workers[decode_worker].handle.fall_back(work.request_id)
