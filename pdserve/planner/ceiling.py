"""The compute ceiling: requests/s of a workload sample that no split of the GPUs can exceed,
whatever the router does.

Every generated token but the last is computed once at least, and every prompt token but those
of a prefix an earlier prompt of the sample shares (a cache that kept every block could serve
those: the suite's agentic sessions and phases share long contexts; the planner's prompts share
none), and under the analytical timing model no step is shorter than its FLOPs at the
profile's share of peak (`AnalyticalTiming.compute_seconds`). So the GPUs,
all computing all the time, serve at most `workers / mean compute seconds per request`. A
goodput above it is not sustainable: it comes from a probe that ended before its load built up
(a burst the workers' batch slots absorbed). A fitted profile has no FLOPs: no ceiling.
"""

from __future__ import annotations

from pdserve.core.prompt_tokens import block_hashes_of
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
    seconds, seen = 0.0, set()  # seen: the blocks of every earlier prompt
    for request in sample:
        hashes = block_hashes_of(request.prompt, config.block_size)
        shared = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        seen.update(hashes)
        # One chunk past the shared prefix over every computed token: the same FLOPs as the
        # prefill and decode steps that compute them (attention pairs, too, count 1..n keys).
        start = min(shared * config.block_size, len(request.prompt) - 1)
        computed = len(request.prompt) - start + request.output_len - 1
        work = StepWork.of([Chunk(start, computed, False)], request.output_len)
        seconds += timing.compute_seconds(work)
    return workers * len(sample) / seconds
