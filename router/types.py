"""The types the router's modules pass between them, and the interface it needs from a worker.

Routing produces a `Route` per attempt, RequestFlow runs it and fills `Progress`, observability
records both; none of them imports another for these. `WorkerHandle` is everything the router
calls on a worker: the Ray actors are adapted to it in router/ray_worker.py, and tests hand
RequestFlow in-process objects that implement it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.core.messages import KVReservation, PrefillResult, TokenBatch, WorkerStats, WorkRequest
from router.estimates import Estimate
from router.peer_pull import PeerPull


class NoWorkerAvailable(RuntimeError):
    """No healthy worker can serve the request (after retries): UNAVAILABLE."""


class Overloaded(RuntimeError):
    """Admission control refused the request, or no room freed up in time: RESOURCE_EXHAUSTED."""


class AtCapacity(Overloaded):
    """Every worker that could take the request is full now (KV blocks, prompt queue); room
    may free up in a moment, so RequestFlow waits briefly before refusing."""


class WorkerHandle(Protocol):
    """One worker as the router calls it. Prefill workers answer `prefill`; decode workers
    `reserve`, `generate` and `stream`; both the rest. Failures raise any exception."""

    async def ready(self) -> dict: ...

    async def stats(self) -> WorkerStats: ...

    async def heartbeat(self) -> float:
        """Answered without waiting for the engine: the seconds its current step has run
        (0 = idle). No answer means the process is frozen or gone."""
        ...

    async def reserve(self, work: WorkRequest) -> KVReservation | None:
        """Blocks for the prompt's KV to arrive in; None when the KV pool has no room now."""
        ...

    def prefill(
        self, work: WorkRequest, reservation: KVReservation
    ) -> AsyncIterator[PrefillResult]:
        """Computes the prompt and yields the result at its first token; then pushes the KV
        into the reservation, commits it and yields the result again (unless the first token
        ended the request)."""
        ...

    async def generate(self, work: WorkRequest) -> None:
        """Admits the request for a local prefill; its tokens come out of `stream`."""
        ...

    def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        """The request's token batches after the first token, the last one finished."""
        ...

    async def abort(self, request_id: str) -> None:
        """Ends the request in whatever state it is and frees its blocks; idempotent."""
        ...

    async def reserve_pull(
        self, work: WorkRequest, pulled_blocks: int, deadline_s: float
    ) -> KVReservation | None:
        """A decode worker reserves the prompt to pull its blocks up to `pulled_blocks` from a
        peer (push_prefix), then prefills the rest; None when the KV pool has no room now.
        Only with --peer-pull."""
        ...

    async def push_prefix(
        self,
        request_id: str,
        prefix_token_ids: list[int],
        first_block: int,
        endpoint: str,
        transfer_id: str,
        deadline: float,
    ) -> int:
        """A decode worker pushes its cached blocks of the prefix from `first_block` on into
        a peer's pull; the bytes sent. Raises when it no longer holds them."""
        ...

    async def fall_back(self, request_id: str) -> None:
        """A pulling decode worker stops waiting for the blocks and prefills them."""
        ...

    async def set_role(self, role: str) -> dict:
        """A switchable worker serves `role` from now on; says what it kept (`blocks_kept`).
        Only --role-switching deployments call it (router/role_switch.py)."""
        ...


@dataclass(frozen=True)
class Route:
    """Where one attempt runs, and what the policy knew when it chose."""

    decode_worker: str
    prefill_worker: str | None = None  # None: the decode worker prefills locally
    reason: str = ""  # how the policy chose
    cached_tokens: int = 0  # prompt tokens the prefilling worker should find in its cache
    decode_cached_tokens: int = 0  # prompt tokens the decode worker already holds
    cached_blocks: Mapping[str, int] = field(default_factory=dict)  # every worker's, for traces
    estimate: Estimate | None = None  # the chosen option's predicted costs
    # The prompt's full-block hashes: the decode worker holds them once a push commits.
    block_hashes: tuple[int, ...] = ()
    # Prefills routed to the prefill worker so far, set when it was idle at routing time: if
    # the count is unchanged when this prefill ends, it ran alone and its timing is a sample.
    prefills_routed: int | None = None
    # The (when, prompt tokens to compute, KV blocks held) the router counts on the prefilling
    # worker until a poll shows this request, or its prompt is computed (on_prompt_computed).
    routed: tuple[float, int, int] | None = None
    # When a remote prefill's first answer came (Routing.on_prompt_computed; a list, the one
    # thing set after routing on this frozen route): with `routed`, what its handoff took.
    first_answer_at: list[float] = field(default_factory=list)
    # Set when the decode worker prefills locally but pulls the prefix a peer caches instead of
    # recomputing it (router/peer_pull.py).
    peer_pull: PeerPull | None = None


@dataclass
class Progress:
    """What the server needs to build responses: the stream so far and where time went."""

    received: float  # perf_counter at receipt
    prompt_tokens: int
    cached_tokens: int = 0  # of the client's prompt, whichever attempt computed it
    completion_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    first_token_at: float | None = None
    prefill_worker: str = ""
    decode_worker: str = ""
    disaggregated: bool = False
    attempts: int = 0
    route: Route | None = None


# (prompt_ids, max_tokens, excluded worker ids) -> Route, awaited on the router's event loop
# (Routing.choose_async); raises Overloaded / NoWorkerAvailable
RouteChooser = Callable[[list[int], int, set[str]], Awaitable[Route]]
