"""Closed-loop arrivals on the virtual cluster: a fixed number of clients, each waiting for its
answer before it sends its next request, as benchmark clients in "concurrency" mode do
(guidellm, aiperf) and as a user replies after reading the answer.

Each client takes the next conversation not yet started (in the order of their first turns)
and sends its turns one after the other, each `think_s` after the previous one ended, then
takes the next conversation; so at most `clients` requests are in flight, and a
conversation's turn never starts before its previous turn ended. A failed request frees its
client as a completed one does; the conversation goes on with its next turn (its prompts are
fixed by the workload), so every policy is offered the same requests.

Under this load a policy that shortens requests raises the throughput (clients x tokens per
request / latency), where open-loop arrivals below saturation deliver the same tokens/s under
every policy: the regime of published prefix-routing throughput gains.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.config import RouterConfig
from pdserve.planner.cluster import RouterTiming, VirtualCluster
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import YOUNG_COLLECTION_ALLOCATIONS, Split, young_collections_every
from pdserve.planner.virtual_request import VirtualRequest
from pdserve.planner.workload import ProbeRequest


def conversations_of(requests: Sequence[ProbeRequest]) -> list[list[ProbeRequest]]:
    """The requests grouped by tag (the tenants workload tags a conversation's turns
    "c<conv>"), turns in their order, conversations in the order of their first turns."""
    grouped: dict[str, list[ProbeRequest]] = {}
    for request in requests:
        grouped.setdefault(request.tag, []).append(request)
    return list(grouped.values())


class _Clients:
    """Sends each conversation's turns in turn from `clients` clients; hears every request's
    end (VirtualRequest's observer)."""

    def __init__(
        self, cluster: VirtualCluster, conversations: list[list[ProbeRequest]], think_s: float
    ) -> None:
        self.cluster, self.think_s = cluster, think_s
        self.runs = {r.index: VirtualRequest(cluster, r, self) for c in conversations for r in c}
        self._waiting = iter(conversations)  # conversations no client has taken yet
        self._next_turn: dict[int, list[ProbeRequest]] = {}  # a request's index: turns left
        self.in_flight = self.peak_in_flight = self.finished = 0

    def start_client(self) -> None:
        """The client takes the next conversation, if any is left, and sends its first turn."""
        conversation = next(self._waiting, None)
        if conversation is not None:
            self._send(conversation[0], conversation[1:])

    def _send(self, request: ProbeRequest, rest: list[ProbeRequest]) -> None:
        self._next_turn[request.index] = rest
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.runs[request.index].start()

    def first_token(self, request: VirtualRequest) -> None:
        pass  # a client waits for the whole answer

    def ended(self, request: VirtualRequest) -> None:
        self.in_flight -= 1
        self.finished += 1
        rest = self._next_turn.pop(request.probe.index)
        if rest:
            self.cluster.loop.after(self.think_s, lambda: self._send(rest[0], rest[1:]))
        else:
            self.cluster.loop.after(self.think_s, self.start_client)


def run_closed_loop(
    deployment: Deployment,
    split: Split,
    requests: Sequence[ProbeRequest],
    clients: int,
    router_config: RouterConfig,
    think_s: float = 0.0,
    timing: RouterTiming = RouterTiming(),
    index_lag_s: float | None = None,
    router_replicas: int = 1,
) -> tuple[list[VirtualRequest], int]:
    """Serves every request of `requests` (conversations: conversations_of) from `clients`
    clients, all starting at time 0; returns the requests' runs, in `requests`' order, and the
    most that were ever in flight at once. `index_lag_s`, `router_replicas`: as run_probe's."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    # Fewer cyclic collections, as run_probe makes them (probe.py says why).
    with young_collections_every(YOUNG_COLLECTION_ALLOCATIONS):
        cluster = VirtualCluster(
            deployment, split.prefill, split.decode, router_config, timing, False,
            index_lag_s, router_replicas,
        )  # fmt: skip
        driver = _Clients(cluster, conversations_of(requests), think_s)
        for _ in range(clients):
            cluster.loop.at(0.0, driver.start_client)
        total = len(driver.runs)
        cluster.loop.run(lambda: driver.finished == total)
    return [driver.runs[r.index] for r in requests], driver.peak_in_flight
