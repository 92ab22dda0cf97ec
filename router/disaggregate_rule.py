"""Which kinds of option a request gets under `--disaggregate` (pdserve/disaggregate_modes.py):
remote prefills (a prefill worker with a decode worker), local ones (a decode worker alone),
or both for the cost policy to choose between (`auto`).

The field's rules decide the kind before any worker is scored, as their routers do: llm-d's
threshold on the prompt tokens the decode side lacks, and Dynamo's conditional rule, which
adds a bound on the prefill queue. Pure arithmetic on the policy's snapshot; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdserve.disaggregate_modes import DisaggregateMode
from router.estimates import RoutingRequest, WorkerLoad


def option_kinds(
    mode: DisaggregateMode,
    request: RoutingRequest,
    prefill: Sequence[WorkerLoad],
    decode: Sequence[WorkerLoad],
    cached: Mapping[str, int],
) -> tuple[bool, bool]:
    """(remote, local): whether options pair a prefill worker, and whether D alone. Without a
    healthy prefill worker every mode prefills locally; so it does when the only one is the
    only decode worker, hybrid (a remote prefill pairs two workers)."""
    if not prefill or (
        len(prefill) == len(decode) == 1 and prefill[0].worker_id == decode[0].worker_id
    ):
        return False, True
    if mode.kind == "auto":
        return True, True
    if mode.kind in ("always", "never"):
        return mode.kind == "always", mode.kind == "never"
    # The decode side's best hit: llm-d checks the hit of the decode pod its scorers chose,
    # and a prefix-aware choice is the worker holding the longest prefix.
    held = max((min(cached.get(d.worker_id, 0), request.full_blocks) for d in decode), default=0)
    remote = request.uncached_tokens(held) > mode.min_uncached_tokens
    if remote and mode.kind == "conditional":
        # Dynamo's prefill queue is one queue all prefill workers pull from; with a queue per
        # worker, the shortest is where the next remote prefill would start soonest.
        remote = min(p.queued_requests for p in prefill) < mode.max_prefill_queue
    return remote, not remote
