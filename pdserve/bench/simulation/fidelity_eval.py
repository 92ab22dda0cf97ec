"""The evaluation half of `pdserve bench fidelity --eval-workloads ... --real-repeats K`:
fidelity stated against the real system's own spread (issue 49 point 0).

A single real run is no fixed target: on a shared CPU the real system's p90 moved 36-40 %
against itself a minute later. So the real system serves each evaluation workload K times
(the same requests, the same arrivals), the sim once among those runs, and each reported
percentile gets the real band [min, max] over the K runs; the sim agrees when it lies in
that band widened by BAND_MARGIN (lo / 1.1 .. hi x 1.1).

The evaluation workloads are not the calibration's (the mixed workload at --rates): each
differs from it in lengths, rate and prefix sharing, so the profile is judged on traffic it
was not fitted on.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Any

from pdserve.workloads.datasets import DatasetConfig

BAND_MARGIN = 0.1
METRICS = (("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50"), ("tpot", "p90"))


@dataclass(frozen=True)
class EvalWorkload:
    """A workload the profile was not calibrated on, offered at `rate_factor` x the highest
    calibration rate."""

    dataset: DatasetConfig
    rate_factor: float
    about: str


EVAL_WORKLOADS = {
    "short": EvalWorkload(
        DatasetConfig(
            name="random", random_input_len=96, random_output_len=24, random_range_ratio=0.5
        ),
        rate_factor=1.5,
        about="short prompts and answers (48-144 in, 12-36 out), no sharing, 1.5x the rate",
    ),
    "long": EvalWorkload(
        DatasetConfig(
            name="mixed",
            mixed_long_fraction=0.5,
            mixed_long_input_len=768,
            mixed_long_output_len=24,
            mixed_short_input_len=192,
            mixed_short_output_len=32,
        ),
        rate_factor=0.5,
        about="half 768-token prompts (24 out), half 192 (32 out), no sharing, 0.5x the rate",
    ),
    "prefix": EvalWorkload(
        DatasetConfig(
            name="shared-prefix",
            gsp_num_groups=4,
            gsp_system_prompt_len=384,
            gsp_question_len=48,
            gsp_output_len=48,
        ),
        rate_factor=0.75,
        about="4 groups sharing a 384-token system prompt, 48-token questions, 48 out, 0.75x",
    ),
}


def add_eval_arguments(
    p: argparse.ArgumentParser, *, workloads: str, repeats: int, real: str
) -> None:
    """--eval-workloads and --real-repeats, shared by both fidelity benches (`real` names what
    serves the real runs)."""
    p.add_argument(
        "--eval-workloads",
        default=workloads,
        help="the measured workloads, comma-separated (none: the calibration's mix at --rates): "
        + "; ".join(f"{name}: {w.about}" for name, w in EVAL_WORKLOADS.items()),
    )
    p.add_argument(
        "--real-repeats",
        type=int,
        default=repeats,
        help=f"{real} serves each measured workload this many times, around the sim's run; "
        "from 2, each percentile is judged against the real runs' band widened by 10%%",
    )


def parse_eval_workloads(value: str) -> list[str]:
    """--eval-workloads as names of EVAL_WORKLOADS; ValueError naming the flag otherwise."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in EVAL_WORKLOADS]
    if unknown or not names:
        raise ValueError(
            f"--eval-workloads: {unknown or value!r} not among {', '.join(EVAL_WORKLOADS)}"
        )
    return names


def eval_requests(name: str, model_config: dict, num_requests: int, seed: int) -> list:
    from pdserve.bench.common.local_system import eos_ids
    from pdserve.workloads.datasets import generate_requests

    dataset = EVAL_WORKLOADS[name].dataset
    if dataset.name == "shared-prefix":  # enough questions per group for num_requests
        per_group = math.ceil(num_requests / dataset.gsp_num_groups)
        dataset = replace(dataset, gsp_prompts_per_group=per_group)
    return generate_requests(
        dataset, num_requests, seed, model_config["vocab_size"], eos_ids(model_config)
    )


def eval_rate(name: str, calibration_rates: list[float]) -> float:
    return round(EVAL_WORKLOADS[name].rate_factor * max(calibration_rates), 3)


def run_order(systems: list[str], real_repeats: int) -> list[str]:
    """The order in which one workload is served: the sims amid the real repeats (real, sim,
    real for K=2), so the real band spans the minutes the sims ran in."""
    first = math.ceil(real_repeats / 2)
    sims = [name for name in systems if name != "real"]
    return ["real"] * first + sims + ["real"] * (real_repeats - first)


def band(real: list[float], sim: float, margin: float = BAND_MARGIN) -> dict[str, Any]:
    """The real runs' [lo, hi], widened by `margin` (lo / (1 + margin) .. hi x (1 + margin)),
    and whether `sim` lies in it."""
    lo, hi = min(real), max(real)
    return {
        "lo": lo,
        "hi": hi,
        "sim": sim,
        "within": lo / (1 + margin) <= sim <= hi * (1 + margin),
    }


def bands(real_runs: list[dict], sim: dict) -> dict[str, dict[str, Any]]:
    """A band per reported percentile, keyed like "ttft_p50", from the real runs' summaries."""
    return {
        f"{metric}_{pct}": band([run[metric][pct] for run in real_runs], sim[metric][pct])
        for metric, pct in METRICS
    }


def within_count(by_workload: dict[str, dict[str, dict]]) -> dict[str, int]:
    verdicts = [b["within"] for rows in by_workload.values() for b in rows.values()]
    return {"within": sum(verdicts), "of": len(verdicts)}


def band_table(result: dict) -> Any:
    from rich.table import Table

    repeats = len(next(iter(result["real_repeats"].values())))
    table = Table(
        title=f"sim vs the real band over {repeats} real runs (min-max, widened by "
        f"{BAND_MARGIN:.0%}: ok)"
    )
    for column in ("workload", "rate/s", "metric", "real lo", "real hi", "sim", ""):
        table.add_column(column, justify="right")
    for workload, rows in result["bands"].items():
        for metric, pct in METRICS:
            row = rows[f"{metric}_{pct}"]
            table.add_row(
                workload,
                f"{result['rates'][workload]:g}",
                f"{metric.upper()} {pct}",
                f"{row['lo']:.2f}",
                f"{row['hi']:.2f}",
                f"{row['sim']:.2f}",
                "ok" if row["within"] else "OFF",
            )
    return table
