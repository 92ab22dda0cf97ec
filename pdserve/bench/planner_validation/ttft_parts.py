"""Where a disaggregated request's time to first token went, offline and live, per request
index, so the two sides can be compared request by request (the same requests arrive at the
same simulated instants on both).

Parts, in simulated milliseconds, from the router's receipt of the request:
- `queue`: on the prefill worker, from its add until its first step (PrefillResult.queue_s);
- `prefill`: the prefill worker's call less its queue: waiting for the step in progress, the
  prompt's steps, the first token's delivery (PrefillResult.prefill_s);
- `handoff`: the rest of the router's TTFT: routing, room waits, the reservation (its wait
  for the decode worker's step in progress), live the Ray round trips;
- `client`: live only, the client's TTFT less the router's (the router's own API hops).
Plus `transfer`, the push, which follows the first token (it delays the second): live it also
holds the commit's round trip, which waits for the decode worker's step in progress
(grpc_sender.send's seconds), offline too (VirtualRequest._pushed); the request's `ttft` and
`tpot` as the client saw them (ms); and `local` (1: prefilled on its decode worker, whose TTFT
is all `handoff` and `client` here: the parts are the disaggregated path's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PARTS = ("queue", "prefill", "transfer", "handoff", "client")


def offline_parts(runs: Iterable) -> dict[int, dict[str, float]]:
    """index -> parts of each completed VirtualRequest of a probe."""
    parts = {}
    for run in runs:
        record, result = run.record, run.prefill_result
        if not record.ok:
            continue
        ttft = record.ttft * 1e3
        if run.route.prefill_worker is None or result is None:
            parts[record.index] = _parts(0.0, 0.0, 0.0, ttft, ttft, record.tpot, local=True)
            continue
        queue, prefill = result.queue_s * 1e3, result.prefill_s * 1e3
        transfer = result.transfer_s * 1e3
        parts[record.index] = _parts(queue, prefill, transfer, ttft, ttft, record.tpot)
    return parts


def live_parts(records: Sequence, time_scale: float) -> dict[int, dict[str, float]]:
    """index -> parts of each completed live request; records in simulated time
    (sim_run.to_sim_time), their server timings in wall milliseconds."""
    parts = {}
    for record in records:
        timings = record.server_timings
        if not record.ok:
            continue
        queue, prefill, transfer, server_ttft = (
            timings.get(f"{name}_ms", 0.0) / time_scale
            for name in ("queue", "prefill", "transfer", "ttft")
        )
        ttft, local = record.ttft * 1e3, not timings.get("disaggregated")
        if local:
            queue = prefill = transfer = 0.0
        parts[record.index] = _parts(
            queue, prefill, transfer, server_ttft, ttft, record.tpot, local=local
        )
    return parts


def _parts(queue, prefill, transfer, server_ttft, ttft, tpot, local=False) -> dict[str, float]:
    return {
        "local": float(local),
        "queue": queue,
        "prefill": prefill,
        "transfer": transfer,
        "handoff": server_ttft - queue - prefill,
        "client": ttft - server_ttft,
        "ttft": ttft,
        "tpot": 0.0 if tpot is None else tpot * 1e3,
    }


def compare(
    planned: dict, live: dict, local: bool = False
) -> tuple[int, dict[str, tuple[float, float]]]:
    """Over the request indices disaggregated (`local`: prefilled locally) on both sides:
    their count and each part's mean (planned, live). Means, so the parts add up to the
    TTFT's mean."""
    common = [
        i
        for i in sorted(set(planned) & set(live), key=int)
        if planned[i]["local"] == live[i]["local"] == float(local)
    ]
    if not common:
        return 0, {}
    means = {}
    for name in (*PARTS, "ttft", "tpot"):
        means[name] = (
            sum(planned[i][name] for i in common) / len(common),
            sum(live[i][name] for i in common) / len(common),
        )
    return len(common), means


def first_routed_apart(planned: dict, live: dict) -> tuple[int | None, int]:
    """(the first request index prefilled locally on one side and remotely on the other, or
    None; how many were). From that request on the two runs' queues, and the costs their
    routers learn, differ: later parts compare different situations, not the same one."""
    apart = sorted(
        int(i) for i in set(planned) & set(live) if planned[i]["local"] != live[i]["local"]
    )
    return (apart[0] if apart else None), len(apart)


def parts_line(planned: dict, live: dict) -> str:
    """Where the routes went apart; mean ms planned/live of each part over the requests both
    disaggregated, and of TTFT and TPOT over those both prefilled locally."""
    first, count = first_routed_apart(planned, live)
    lines = [f"{count} routed apart, first request {first}" if count else "all routed alike"]
    count, means = compare(planned, live)
    if count:
        shown = ", ".join(f"{name} {p:.1f}/{q:.1f}" for name, (p, q) in means.items())
        lines.append(f"mean ms planned/live over {count} disaggregated on both: {shown}")
    count, means = compare(planned, live, local=True)
    if count:
        shown = ", ".join(
            f"{name} {means[name][0]:.1f}/{means[name][1]:.1f}"
            for name in ("handoff", "client", "ttft", "tpot")
        )
        lines.append(f"over {count} local on both: {shown}")
    if len(lines) == 1:
        lines.append("no request routed alike on both sides")
    return "; ".join(lines)
