"""Online planning: the split the planner chooses for a window of served traffic, priced with
costs a live router measured (`pdserve serve --plan-interval S`, router/online_plan.py).

The router cannot import the planner (it would import the engine), so it runs this module as a
child process: `python -m pdserve.planner.online` reads one JSON window on stdin and prints one
JSON plan on stdout. The window holds what the router knows without asking anyone: the
requests it served (prompt and output lengths, arrival times), its cost model's lines
(prefill seconds per token, decode step seconds per sequence and per step), the workers' KV
pool and engine limits, and the SLOs. The search is the offline one (`search.Search`) over
every split of the live worker count, with the measured lines as a `linear` timing profile.

Measured lines map onto `LinearTiming` as: step_s = the decode line's intercept (a step's
fixed cost), decode_seq_s = its slope, prefill_token_s = the prefill line's slope;
context_token_s = 0 (the router's lines do not separate the attention term). The prefill
line's own intercept is not kept: it lumps per-request overheads that an engine step pays
once, whatever it batches.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO
from pdserve.planner.search import Plan, Search, sampled_requests_per_worker
from pdserve.planner.splits import all_splits
from pdserve.planner.workload import PlanRequest, probe_sample

MIN_REQUESTS = 20  # a window with fewer served requests says too little to plan from


@dataclass
class TrafficWindow:
    """What the router sends: one window of served traffic and the costs it measured."""

    model: str  # model directory (config.json and tokenizer)
    workers: int  # live workers (prefill + decode): every split of them is searched
    requests: list[tuple[int, int, float]]  # (prompt_len, output_len, arrival_s)
    window_s: float  # the span the requests arrived in
    prefill_token_s: float  # prefill seconds per prompt token
    step_s: float  # a decode step's fixed seconds
    decode_seq_s: float  # a decode step's seconds per sequence
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    dtype: str = "float32"
    link_gbps: float = 10.0
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    attainment: float = 0.9
    # Fewer over-rate the goodput (a short probe absorbs its requests as a burst): 300 came
    # within 10% of 600 on the built-in model's costs, in ~14 s for 2 workers (docs/planner.md).
    requests_per_worker: int = 300
    precision: float = 0.1
    extra: dict[str, Any] = field(default_factory=dict)  # kept in the answer (e.g. timestamps)

    @property
    def observed_rate(self) -> float:
        return len(self.requests) / self.window_s if self.window_s > 0 else 0.0


def plan_window(window: TrafficWindow) -> dict[str, Any]:
    """The recommended split for the window's traffic, its predicted goodput, and how that
    compares with the rate the window saw. ValueError when the window cannot be planned."""
    if len(window.requests) < MIN_REQUESTS:
        raise ValueError(f"{len(window.requests)} requests in the window; need {MIN_REQUESTS}")
    if window.workers < 1:
        raise ValueError("no live workers to split")
    with tempfile.TemporaryDirectory(prefix="pdserve-plan-") as tmp:
        profile = Path(tmp) / "measured.json"
        profile.write_text(json.dumps(_linear_profile(window)), encoding="utf-8")
        deployment = Deployment(
            window.model,
            profile=str(profile),
            dtype=window.dtype,
            link_gbps=window.link_gbps,
            max_num_seqs=window.max_num_seqs,
            max_num_batched_tokens=window.max_num_batched_tokens,
            block_size=window.block_size,
            num_kv_blocks=window.num_kv_blocks,
        )
        limit = deployment.max_model_len
        fits = [(p, o) for p, o, _ in window.requests if p + o <= limit]
        if len(fits) < MIN_REQUESTS:
            raise ValueError("too few requests of the window fit the model's context")
        size = sampled_requests_per_worker(deployment, window.requests_per_worker) * window.workers
        sample = probe_sample(_plan_requests(fits, size), size)
        slo = SLO(window.ttft_slo_ms, window.tpot_slo_ms, window.attainment)
        router = RouterConfig(
            ttft_slo_ms=window.ttft_slo_ms,
            tpot_slo_ms=window.tpot_slo_ms,
            max_pending_requests=max(RouterConfig().max_pending_requests, len(sample)),
        )
        search = Search(
            deployment,
            sample,
            slo,
            router,
            precision=window.precision,
            requests_per_worker=window.requests_per_worker,
            min_replica_workers=1,
        )
        plan = search.run(all_splits(window.workers))
    return _answer(plan, window)


def _linear_profile(window: TrafficWindow) -> dict[str, Any]:
    return {
        "kind": "linear",
        "step_s": max(window.step_s, 1e-6),
        "prefill_token_s": max(window.prefill_token_s, 1e-9),
        "decode_seq_s": max(window.decode_seq_s, 0.0),
        "context_token_s": 0.0,
        "source": "the router's measured cost lines",
    }


def _plan_requests(lengths: list[tuple[int, int]], size: int) -> list[PlanRequest]:
    """The window's (prompt, output) lengths, repeated until a probe can draw `size` of them.
    Probes offer them as a Poisson process: a window is too short a trace to load a cluster
    to its steady state (a short probe absorbs its requests as one burst and over-rates the
    goodput), so its lengths are kept and its own arrival pattern is not."""
    repeats = -(-size // len(lengths))
    return [PlanRequest(max(1, p), max(1, o)) for p, o in lengths * repeats]


def _answer(plan: Plan, window: TrafficWindow) -> dict[str, Any]:
    chosen = plan.recommended
    observed = window.observed_rate
    goodput = chosen.goodput
    # Workers for the observed rate if goodput scales with the worker count (a linear
    # extrapolation, said as such wherever it is shown).
    needed = math.ceil(window.workers * observed / goodput) if goodput > 0 else None
    return {
        **window.extra,
        "workers": window.workers,
        "recommended": chosen.split.name,
        "prefill_workers": chosen.split.prefill,
        "decode_workers": chosen.split.decode,
        "colocated": chosen.split.prefill == 0,
        "goodput_rps": goodput,
        "observed_rps": observed,
        "meets_observed": goodput >= observed,
        "workers_for_observed": needed,
        "window_requests": len(window.requests),
        "saturated": chosen.saturated,  # passed at the search's ceiling: goodput is a floor
        "search_seconds": plan.seconds,
        "probes": plan.probes,
        "splits": [
            {"split": r.split.name, "goodput_rps": r.goodput, "pruned": r.pruned}
            for r in plan.results
        ],
    }


def main() -> int:
    """stdin: one TrafficWindow as JSON; stdout: the plan as JSON, or {"error": ...}."""
    try:
        window = TrafficWindow(**json.loads(sys.stdin.read()))
        answer = plan_window(window)
    except (TypeError, ValueError, OSError) as e:
        answer = {"error": " ".join(str(e).split())}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
