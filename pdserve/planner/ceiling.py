"""The compute ceiling: requests/s of a workload sample that no split of the GPUs can exceed,
whatever the router does.

Every prompt token and every generated token but the last is computed once at least (the
planner's prompts share no prefixes), and under the analytical timing model no step is shorter
than its FLOPs at the profile's share of peak (`AnalyticalTiming.compute_seconds`). So the GPUs,
all computing all the time, serve at most `workers / mean compute seconds per request`. A
goodput above it is not sustainable: it comes from a probe that ended before its load built up
(a burst the workers' batch slots absorbed). A fitted profile has no FLOPs: no ceiling.
"""

from __future__ import annotations

from pdserve.planner.deployment import Deployment
from pdserve.planner.workload import ProbeRequest
from pdserve.sim.profiles import parse_profile, timing_model
from pdserve.sim.timing import AnalyticalTiming, Chunk, StepWork


def compute_ceiling(
    deployment: Deployment, sample: list[ProbeRequest], workers: int
) -> float | None:
    """Requests/s of `sample` that `workers` workers compute at most; None without FLOPs."""
    config = deployment.engine_config
    timing = timing_model(parse_profile(deployment.profile), deployment.model_config, config.dtype)
    if not isinstance(timing, AnalyticalTiming) or not sample:
        return None
    seconds = 0.0
    for request in sample:
        # One chunk from position 0 over every computed token: the same FLOPs as the prefill
        # and decode steps that compute them (attention pairs, too, count 1..n keys).
        computed = len(request.prompt) + request.output_len - 1
        work = StepWork.of([Chunk(0, computed, False)], request.output_len)
        seconds += timing.compute_seconds(work)
    return workers * len(sample) / seconds
