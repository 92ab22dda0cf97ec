"""`pdserve bench fidelity`: does a sim worker with a profile fitted on the CPU engine reproduce
the real CPU system's latencies? (issue 14 point 3)

In one run:
1. calibrate: 1 prefill + 1 decode torch worker (every prompt prefilled remotely, KV over grpc
   on loopback) serve a calibration workload (the measured mix at the measured rates, other
   requests) while every step, gap between steps and KV push is recorded inside them
   (fidelity_calibration.py); the steps fit a linear `--sim-profile` (every sample: what else
   the worker does on its core is part of a CPU step's cost) with the spread of the steps
   around the fit and of the gaps (which the sim draws from, seeded), the pushes a fixed cost +
   bytes at a link rate;
2. a 1P+1D sim system with that profile, time scale 1 and that link rate starts from a child
   process on the same Ray cluster (child_system.py), next to the real one;
3. both serve the same requests, open-loop Poisson, rate by rate, interleaved (real, sim) so
   drift in a shared machine's load hits both alike;
4. the report: TTFT and TPOT p50/p90 of both, sim/real, each marked within --tolerance or
   not, and (in --json) what the steps and pushes of each system's measured runs cost.
With --eval-workloads the measured requests are workloads other than the calibration's
(fidelity_eval.py), and with --real-repeats K the real system serves each K times around the
sim's run: each percentile is then judged against the real runs' own band, widened by 10 %.
With --with-mean-sim a third system, sim workers with the same profile less its spread (every
step the fitted mean, as profiles were before), serves the same requests interleaved with the
other two: what the spread changes, under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from pdserve.bench.common.local_system import (
    add_mixed_arguments,
    add_model_arguments,
    load_model,
    mixed_requests,
    serve_locally,
    start_ray,
)
from pdserve.bench.simulation.child_system import ChildSystem
from pdserve.bench.simulation.fidelity_calibration import install_recorders, pacing, take_samples
from pdserve.bench.simulation.fidelity_eval import (
    EVAL_WORKLOADS,
    METRICS,
    add_eval_arguments,
    band_table,
    bands,
    eval_rate,
    eval_requests,
    parse_eval_workloads,
    run_order,
    within_count,
)

GBIT = 10**9 / 8  # bytes per second in one Gbit/s
# A worker slowed down by other processes on a shared CPU is not failed over here: this bench
# measures latencies, not failover, and a retry would count twice in them.
PROGRESS_TIMEOUT_S = 120.0
ROUTER = {"disaggregate": "always", "progress_timeout_s": PROGRESS_TIMEOUT_S}
# The sim link when the pushes' time does not grow with their bytes: no measurable per-byte cost.
UNMEASURABLE_LINK_GBPS = 1e6


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, preset="small")
    p.add_argument("--rates", default="0.5,1", help="request rates (req/s), comma separated")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate")
    p.add_argument("--seed", type=int, default=0)
    add_mixed_arguments(
        p, long_fraction=0.2, long_input=1024, long_output=16, short_input=64, short_output=64
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="token budget of one step"
    )
    p.add_argument(
        "--tolerance", type=float, default=0.2, help="sim/real within 1 +- this counts as agreeing"
    )
    p.add_argument("--profile-out", help="keep the fitted profile in this file")
    p.add_argument(
        "--with-mean-sim",
        action="store_true",
        help="also serve on sim workers with the profile less its spread (the fitted mean)",
    )
    add_eval_arguments(p, workloads="", repeats=1, real="the real system")
    p.add_argument("--json", help="write both systems' summaries and the ratios to this file")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if args.num_requests < 1:
        raise SystemExit("--num-requests must be >= 1")
    if args.real_repeats < 1:
        raise SystemExit("--real-repeats must be >= 1")
    if args.eval_workloads:
        try:
            parse_eval_workloads(args.eval_workloads)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    result = measure(args, console.print)
    console.print(fidelity_table(result, args.tolerance))
    if "sim_mean" in result:
        console.print(fidelity_table(result, args.tolerance, "sim_mean"))
    if "bands" in result:
        console.print(band_table(result))
        count = result["within_band"]
        console.print(
            f"sim within the real band widened by 10%: {count['within']} of {count['of']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    runs = [s for system in ("sim", "sim_mean") for s in result.get(system, {}).values()]
    runs += [s for repeats in result["real_repeats"].values() for s in repeats]
    failed = sum(s["failed"] for s in runs)
    return 0 if failed == 0 else 1


def measure(args: argparse.Namespace, say: Any = print) -> dict:
    """Calibrates on the real system, serves every rate on it and on the sim system; returns
    {"profile", "link_gbps", "real": {rate: summary}, "sim": {...}, "ratios": {rate:
    {"ttft_p50": sim/real, ...}}, "diagnosis": what each system's workers spent}, and with
    --with-mean-sim "sim_mean" and "ratios_mean" of the sim without the profile's spread.
    Keyed by rate ("4"), or with --eval-workloads by workload name; "rates" maps the keys to
    their rates, "real_repeats" to every real run ("real" holds the first), and from 2 real
    repeats "bands" ({key: {"ttft_p50": {"lo", "hi", "sim", "within"}}}) and "within_band"."""
    from pdserve.bench.engine.step_recorder import write_profile
    from pdserve.engine_config import SimConfig
    from pdserve.sim.profiles import parse_profile

    model_dir, model_config = load_model(args)
    rates = [float(r) for r in args.rates.split(",")]

    def workload(index: int, num_requests: int = args.num_requests) -> list:
        return mixed_requests(args, model_config, num_requests, args.seed + index)

    if args.eval_workloads:
        measured = {
            name: (eval_rate(name, rates), eval_requests(name, model_config, args.num_requests,
                                                         args.seed + 100 + i))
            for i, name in enumerate(parse_eval_workloads(args.eval_workloads))
        }  # fmt: skip
    else:
        measured = {f"{rate:g}": (rate, workload(i)) for i, rate in enumerate(rates)}
    # Calibrated on requests of the same mix at the same rates that are never measured.
    calibration = {rate: workload(len(rates) + i) for i, rate in enumerate(rates)}
    warm_up = workload(2 * len(rates), 4)
    engine = {"dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens}
    profile = args.profile_out or str(Path(tempfile.mkdtemp()) / "cpu-profile.json")
    systems = 3 if args.with_mean_sim else 2
    start_ray(systems, systems)  # a prefill and a decode worker for each system
    with _system(model_dir, engine) as real_app:
        say("[bold]real[/bold]: 1 prefill + 1 decode torch worker; calibrating")
        send_requests(real_app, warm_up, None, args.seed)
        install_recorders(real_app.app)
        for rate, requests in calibration.items():
            send_requests(real_app, requests, rate, args.seed)
        steps, transfers, gaps = take_samples(real_app.app)
        notes = {"device": "cpu", "model": str(model_dir), "dtype": args.dtype}
        say(write_profile(steps, profile, every_sample=True, gaps=gaps, **notes))
        pushes = push_costs(transfers)
        link_gbps = pushes["link_gbps"] or UNMEASURABLE_LINK_GBPS
        say(f"KV pushes: {pushes}")
        say("[bold]sim[/bold]: 1 prefill + 1 decode sim worker (a child process)")
        profiles = {"sim": profile}
        if args.with_mean_sim:
            profiles["sim_mean"] = _without_spread(profile)
        with contextlib.ExitStack() as stack:
            served = {"real": real_app}
            for name, path in profiles.items():
                sim = {"kind": "sim", "sim": SimConfig(profile=path, link_gbps=link_gbps)}
                served[name] = stack.enter_context(
                    ChildSystem(model_dir, {**engine, **sim}, ROUTER)
                )
                send_requests(served[name], warm_up, None, args.seed)
                served[name].call(install_recorders)
            paced_before = served["sim"].call(pacing)
            summaries: dict[str, dict] = {name: {} for name in served}
            repeats: dict[str, list[dict]] = {key: [] for key in measured}
            # Interleaved, workload by workload: drift in the machine's load hits every system
            # alike.
            for key, (rate, requests) in measured.items():
                for name in run_order(list(served), args.real_repeats):
                    records = send_requests(served[name], requests, rate, args.seed)
                    summary = {**run_summary(records), "decode_pace": decode_pace(records)}
                    if name == "real":
                        repeats[key].append(summary)
                    else:
                        summaries[name][key] = summary
                    say(f"  {name} {key} at {rate:g}/s: {summary_line(summary)}")
            summaries["real"] = {key: runs[0] for key, runs in repeats.items()}
            sim_spent = served["sim"].call(take_samples)
            paced = served["sim"].call(pacing)
        real_spent = take_samples(real_app.app)
    timing = parse_profile(profile)
    diagnosis = {
        name: {
            "steps": step_costs(spent.steps, timing),
            "spread": spread_of(spent.steps, spent.gaps, timing),
            "pushes": push_costs(spent.transfers),
        }
        for name, spent in (("real", real_spent), ("sim", sim_spent))
    }
    # The sim's own pacing: modelled (spread included) against taken, a step woken late by a
    # busy core takes longer than modelled (not the profile's doing).
    diagnosis["sim"]["pacing"] = {
        key: round(paced[key] - paced_before[key], 4) for key in paced_before
    }
    say(f"measured runs: {diagnosis}")
    real = summaries["real"]
    result = {
        "profile": json.loads(Path(profile).read_text()),
        "link_gbps": link_gbps,
        "calibration_pushes": pushes,
        "rates": {key: rate for key, (rate, _) in measured.items()},
        "real": real,
        "real_repeats": repeats,
        "sim": summaries["sim"],
        "ratios": {key: ratios(real[key], summaries["sim"][key]) for key in real},
        "diagnosis": diagnosis,
    }
    if args.real_repeats >= 2:
        result["bands"] = {key: bands(runs, summaries["sim"][key]) for key, runs in repeats.items()}
        result["within_band"] = within_count(result["bands"])
    if "sim_mean" in summaries:
        result["sim_mean"] = summaries["sim_mean"]
        result["ratios_mean"] = {
            rate: ratios(real[rate], summaries["sim_mean"][rate]) for rate in real
        }
    return result


def _without_spread(profile: str) -> str:
    """A copy of the profile file without its spread, next to it."""
    data = json.loads(Path(profile).read_text(encoding="utf-8"))
    data.pop("spread", None)
    path = Path(profile).with_name(Path(profile).stem + "-mean.json")
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return str(path)


def step_costs(steps: list, timing: Any) -> dict[str, float]:
    """How many steps, their measured seconds and what the profile predicts for them."""
    return {
        "steps": len(steps),
        "measured_s": round(sum(seconds for _, seconds in steps), 4),
        "profile_s": round(sum(timing.step_seconds(work) for work, _ in steps), 4),
    }


def decode_pace(records: list) -> dict[str, float]:
    """p50/p90 over requests of ms per token after the chunk holding the second token: the
    decode worker's pace as the client sees it, without the first token's handoff (a first
    token delivered late, while the decode worker already runs, shortens TPOT: the tokens it
    made meanwhile arrive in a burst)."""
    paces = []
    for record in records:
        received = 0
        for at, count in zip(record.chunk_times, record.chunk_tokens, strict=True):
            received += count
            if received >= 2:
                after = record.output_tokens - received
                if after > 0:
                    paces.append((record.chunk_times[-1] - at) / after * 1e3)
                break
    if not paces:
        return {"p50": 0.0, "p90": 0.0}
    return {"p50": round(_nearest_rank(paces, 0.5), 3), "p90": round(_nearest_rank(paces, 0.9), 3)}


def spread_of(steps: list, gaps: list[float], timing: Any) -> dict[str, list[float]]:
    """p50/p90/p99 of measured / profile mean step seconds (decode and prefill steps apart)
    and of the gaps between steps (ms): do the sim's steps scatter as the real ones did? (A sim
    step with a spread waits out its modelled gap inside the step: its own gaps are only the
    loop's Python work, its ratios hold the modelled gap.)"""
    decode = [s / timing.step_seconds(w) for w, s in steps if not w.prefill_tokens]
    prefill = [s / timing.step_seconds(w) for w, s in steps if w.prefill_tokens]
    return {
        "decode_ratio": _percentiles(decode),
        "prefill_ratio": _percentiles(prefill),
        "gap_ms": _percentiles([gap * 1e3 for gap in gaps if gap]),
    }


def _percentiles(values: list[float]) -> list[float]:
    return [round(_nearest_rank(values, p), 3) for p in (0.5, 0.9, 0.99)] if values else []


def _nearest_rank(values: list[float], fraction: float) -> float:
    """The smallest value with at least `fraction` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def push_costs(transfers: list[tuple[int, float]]) -> dict[str, float]:
    """KV pushes fitted as fixed ms + bytes at link_gbps (0: no measurable cost per byte)."""
    from pdserve.sim.fit import fit_transfer

    if len(transfers) < 2:
        return {"pushes": len(transfers), "fixed_ms": 0.0, "link_gbps": 0.0}
    fixed_s, byte_s = fit_transfer(transfers)
    return {
        "pushes": len(transfers),
        "fixed_ms": round(fixed_s * 1e3, 3),
        "link_gbps": round(1 / byte_s / GBIT, 3) if byte_s else 0.0,
    }


def ratios(real: dict, sim: dict) -> dict[str, float]:
    """sim/real of each reported percentile, keyed like "ttft_p50"."""
    return {
        f"{metric}_{pct}": sim[metric][pct] / real[metric][pct] if real[metric][pct] else 0.0
        for metric, pct in METRICS
    }


def _system(model_dir: Path, engine: dict) -> Any:
    return serve_locally(
        model_dir, prefill_workers=1, decode_workers=1, engine=engine, router=ROUTER
    )


def send_requests(app: Any, requests: list, rate: float | None, seed: int) -> list:
    """The records of `requests` sent open-loop at `rate` (None: one at a time) to the served
    system `app` (anything with the router's `port`)."""
    from pdserve.bench.common.load_generator import run_load

    target = f"127.0.0.1:{app.port}"
    if rate is None:
        return asyncio.run(run_load(target, requests, max_concurrency=1))
    return asyncio.run(run_load(target, requests, request_rate=rate, seed=seed))


def run_summary(records: list) -> dict:
    from pdserve.workloads.metrics import run_duration, summarize

    return summarize(records, run_duration(records)).to_dict()


def summary_line(summary: dict) -> str:
    ttft, tpot, pace = summary["ttft"], summary["tpot"], summary["decode_pace"]
    return (
        f"TTFT p50 {ttft['p50']:.1f} ms p90 {ttft['p90']:.1f} ms, TPOT p50 {tpot['p50']:.1f} "
        f"ms p90 {tpot['p90']:.1f} ms (after the 2nd token {pace['p50']:.1f}/{pace['p90']:.1f} "
        f"ms), failed {summary['failed']}"
    )


def fidelity_table(result: dict, tolerance: float, system: str = "sim", title: str = "") -> Any:
    """The table of `system` ("sim", or "sim_mean": the profile without its spread); `title`
    names what was compared (default: sim vs the 1P+1D real CPU system)."""
    from rich.table import Table

    which = "sim" if system == "sim" else "sim without the spread (fitted mean)"
    title = title or f"{which} vs real CPU workers (first real run), 1P+1D"
    table = Table(title=f"{title} (within ±{tolerance:.0%}: ok)")
    for column in ("workload", "rate/s", "metric", "real ms", "sim ms", "sim/real", ""):
        table.add_column(column, justify="right")
    for key, by_metric in result["ratios" if system == "sim" else "ratios_mean"].items():
        for metric, pct in METRICS:
            ratio = by_metric[f"{metric}_{pct}"]
            table.add_row(
                key if key in EVAL_WORKLOADS else "mixed",
                f"{result['rates'][key]:g}",
                f"{metric.upper()} {pct}",
                f"{result['real'][key][metric][pct]:.1f}",
                f"{result[system][key][metric][pct]:.1f}",
                f"{ratio:.2f}",
                "ok" if abs(ratio - 1) <= tolerance else "OFF",
            )
    return table
