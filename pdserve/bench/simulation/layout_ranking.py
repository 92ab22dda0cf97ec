"""`pdserve bench layout-ranking`: does the simulation rank this machine's layouts as the real
system does? (issue 49 point 6, its CPU half)

Two layouts of the same two workers, each pinned to its own core: 1 prefill + 1 decode worker
(every prompt prefilled remotely, KV over grpc) against 2 colocated workers; each serves suite
workloads scaled down to a CPU (`CPU_WORKLOADS`). In one run:
1. calibrate: each real layout serves the fidelity bench's mixed workload (requests never
   measured) while every step and KV push is recorded inside its workers; one `--sim-profile`
   is fitted on both layouts' steps (prefill-only, decode-only and the colocated workers'
   mixed steps alike), with their spread, and the pushes a link rate and a fixed cost each
   (its RPCs and the commit's round trip, paid by every simulated push as well);
2. the simulation the suite runs (the planner's virtual cluster, `run_probe`, with that
   profile) offers each workload to both layouts at rising rates, `--duration` seconds of
   arrivals each (a steady state, not a burst a short run ends before its queue builds),
   until both fall below the attainment: each layout's simulated goodput;
   with `--workload-calibration`, each real layout then serves the workload itself (prompts
   of their own) at those goodputs' geometric mean, recorded, and the profile is refitted on
   the mix's steps and these: the mix runs small decode batches, so the cost of a decode
   sequence, and what the decode worker's receiving of this workload's KV adds to its steps,
   are measured where they matter; the sweep runs again on that profile;
   the real rates are each layout's goodput x `--rate-factors`, so both crossings are
   bracketed;
3. the real system serves each workload at those rates on both layouts (the same requests and
   arrivals; layouts interleaved rate by rate, so drift in the machine's load hits both), and
   the simulation the same requests at the same rates; while a layout misses at the lowest
   real rate, both serve half of it too (at most `--lower-rates` times): a goodput
   interpolated from zero ranks nothing;
4. per workload: each layout's goodput (DistServe's, over those rates; a request refused at
   capacity counts as a miss) real and simulated, and whether both put the same layout first.
   Goodputs within `--tie` of each other are a tie, which agrees with either order: on a
   shared CPU the real system moves 10-40% against itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.common.local_system import (
    add_mixed_arguments,
    add_model_arguments,
    eos_ids,
    load_model,
    mixed_requests,
    serve_locally,
    start_ray,
)
from pdserve.bench.simulation.child_system import ChildSystem
from pdserve.bench.simulation.fidelity_bench import push_costs, send_requests
from pdserve.bench.simulation.fidelity_calibration import (
    Samples,
    install_recorders,
    take_samples,
)
from pdserve.bench.simulation.layout_ranking_report import ranking_table
from pdserve.bench.simulation.layout_ranking_sim import (
    LAYOUTS,
    SWEEP_START,
    link_gbps,
    rate_point,
    sim_deployment,
    sim_records,
    sim_sweep,
)
from pdserve.workloads.datasets import DatasetConfig

# The suite's workloads (disagg_suite/workloads.py) with prompts and answers a quarter as long:
# the small preset prefills ~0.5 ms a token on one core, so the suite's 2k-6k-token RAG prompts
# would take 1-3 s each, and a rate sweep hours.
CPU_WORKLOADS = {
    "chat": DatasetConfig(
        name="chat-rag",
        rag_fraction=0.0,
        chat_input_median=50,
        chat_output_median=38,
        chat_max_input_len=512,
        chat_max_output_len=128,
    ),
    "code": DatasetConfig(
        name="random", random_input_len=64, random_output_len=8, random_range_ratio=0.5
    ),
    "rag": DatasetConfig(
        name="chat-rag",
        rag_fraction=1.0,
        rag_min_input_len=512,
        rag_max_input_len=1536,
        rag_output_len=25,
    ),
}
# A worker slowed by other processes on a shared CPU is not failed over: this bench measures
# latencies, and a retry would count twice in them.
PROGRESS_TIMEOUT_S = 120.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, preset="small")
    p.add_argument(
        "--workloads",
        default="code,rag",
        help=f"suite workloads scaled to a CPU, comma separated: {', '.join(CPU_WORKLOADS)}",
    )
    p.add_argument(
        "--duration", type=float, default=20.0, help="seconds of arrivals per rate (steady state)"
    )
    p.add_argument("--min-requests", type=int, default=20, help="requests per rate at least")
    p.add_argument(
        "--rate-factors",
        default="0.8,1.25",
        help="real rates: each layout's simulated goodput times these (both layouts at all)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--attainment", type=float, default=0.9, help="goodput's SLO attainment")
    p.add_argument(
        "--tie", type=float, default=0.1, help="goodputs within this ratio of each other tie"
    )
    p.add_argument("--calibration-rates", default="0.5,1", help="req/s of the calibration mix")
    p.add_argument("--calibration-requests", type=int, default=30, help="requests per rate")
    p.add_argument(
        "--workload-calibration",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refit the profile per workload on steps of both layouts serving it (prompts of "
        "its own) at the simulated goodputs' geometric mean",
    )
    p.add_argument(
        "--lower-rates",
        type=int,
        default=2,
        help="halvings of the lowest real rate at most, while a layout misses there",
    )
    add_mixed_arguments(
        p, long_fraction=0.2, long_input=1024, long_output=16, short_input=64, short_output=64
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="token budget of one step"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-out", help="keep the fitted profile in this file")
    p.add_argument("--json", help="write every figure to this file")


@dataclass(frozen=True)
class Ranking:
    """Which layout a system puts first on one workload; None: the goodputs tie."""

    first: str | None
    ratio: float  # the higher goodput over the lower (inf when the lower is 0)


def rank(goodputs: dict[str, float], tie: float) -> Ranking:
    (a, ga), (b, gb) = sorted(goodputs.items(), key=lambda item: -item[1])
    ratio = ga / gb if gb else math.inf if ga else 1.0
    return Ranking(None if ratio <= 1 + tie else a, ratio)


def agree(real: Ranking, sim: Ranking) -> bool:
    """The same layout first, or a tie on either side (within the real system's own noise)."""
    return real.first is None or sim.first is None or real.first == sim.first


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in CPU_WORKLOADS]
    if unknown or not workloads:
        raise SystemExit(f"--workloads {args.workloads!r}: choose from {', '.join(CPU_WORKLOADS)}")
    if args.min_requests < 1 or args.duration <= 0:
        raise SystemExit("--min-requests must be >= 1 and --duration > 0")
    result = measure(args, workloads, console.print)
    console.print(ranking_table(result))
    agreed = sum(w["agree"] for w in result["workloads"].values())
    console.print(f"rankings agree on {agreed} of {len(workloads)} workloads")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def measure(args: argparse.Namespace, workloads: list[str], say: Any = print) -> dict:
    """Calibrates, sweeps the simulation, serves the real rates; returns {"profile",
    "link_gbps", "slo", "workloads": {name: {"rates", "real": {layout: {"goodput", "points"}},
    "sim": {...}, "sim_sweep": {layout: goodput}, "rank_real", "rank_sim", "agree", and with
    --workload-calibration "calibration": {"rate", "profile", "profile_file", "sim_sweep"}}}}."""
    model_dir, model_config = load_model(args)
    calibration_rates = [float(r) for r in args.calibration_rates.split(",")]
    engine = {"max_num_batched_tokens": args.max_num_batched_tokens}
    profile = args.profile_out or str(Path(tempfile.mkdtemp()) / "cpu-profile.json")
    # Both layouts up at once, so their runs interleave: the first served here, the second by
    # a child process (a driver's worker names are its own), each worker pinned to a core.
    start_ray(*(sum(workers[i] for workers in LAYOUTS.values()) for i in (0, 1)))
    with contextlib.ExitStack() as stack:
        systems = {}
        for k, (layout, (prefill, decode, _)) in enumerate(LAYOUTS.items()):
            say(f"[bold]{layout}[/bold]: starting the real system")
            router = _router(layout, args)
            if k == 0:
                app = stack.enter_context(
                    serve_locally(model_dir, prefill_workers=prefill, decode_workers=decode,
                                  engine=engine, router=router)
                )  # fmt: skip
                systems[layout] = _InProcess(app)
            else:
                systems[layout] = stack.enter_context(
                    ChildSystem(model_dir, engine, router, prefill, decode)
                )
        mix = Samples([], [], [])
        for layout, system in systems.items():
            say(f"{layout}: calibrating")
            send_requests(
                system, mixed_requests(args, model_config, 4, args.seed + 500), None, args.seed
            )
            system.call(install_recorders)
            for i, rate in enumerate(calibration_rates):
                requests = mixed_requests(
                    args, model_config, args.calibration_requests, args.seed + 600 + i
                )
                mix = _joined(mix, _recorded(system, requests, rate, args.seed))
        # The pushes of the light calibration load: what one costs besides the queues and
        # the steps in progress it waits for, which the simulation has of its own.
        pushes = push_costs(mix.transfers)
        say(f"KV pushes: {pushes}")
        say(_fit_profile(mix, profile, model_dir))
        run = _WorkloadRun(args, systems, (model_dir, model_config), mix, pushes, say)
        figures = {name: run.measure(name, i, profile) for i, name in enumerate(workloads)}
    return {
        "profile": json.loads(Path(profile).read_text()),
        "link_gbps": link_gbps(pushes),
        "calibration_pushes": pushes,
        "slo": {
            "ttft_ms": args.slo_ttft_ms,
            "tpot_ms": args.slo_tpot_ms,
            "attainment": args.attainment,
        },
        "workloads": figures,
    }


class _WorkloadRun:
    """Steps 2-4 of one workload on the real systems (both up) and the simulation."""

    def __init__(self, args, systems: dict, model: tuple, mix: Samples, pushes: dict, say) -> None:
        self.args, self.systems, self.say = args, systems, say
        (self.model_dir, self.model_config), self.mix, self.pushes = model, mix, pushes

    def measure(self, name: str, index: int, profile: str) -> dict:
        """The workload's figures (see `measure`); `profile` is the mix's fit."""
        args, say = self.args, self.say
        deployment = sim_deployment(self.model_dir, profile, self.pushes, args)

        def offered(rate: float, salt: int = 0) -> list:
            """The workload's requests at `rate`, --duration seconds of arrivals: prompts of
            their own at each rate (the same for both systems), so no run finds the one before
            it in a worker's prefix cache (each simulated run starts cold)."""
            n = max(args.min_requests, math.ceil(rate * args.duration))
            seed = args.seed + 7919 * (index + 1) + round(rate * 1000) + salt
            return _workload_requests(name, self.model_config, n, seed)

        sweep = {layout: sim_sweep(deployment, layout, offered, args) for layout in LAYOUTS}
        found: dict[str, Any] = {}
        if args.workload_calibration:
            rate = _calibration_rate(sweep)
            say(f"{name}: simulated goodput {_fmt(sweep)}; recording both layouts at {rate:g}/s")
            samples = self.mix
            for system in self.systems.values():
                requests = offered(rate, salt=CALIBRATION_SALT)
                samples = _joined(samples, _recorded(system, requests, rate, args.seed))
            path = str(Path(profile).with_suffix(f".{name}.json"))
            say(_fit_profile(samples, path, self.model_dir))
            deployment = sim_deployment(self.model_dir, path, self.pushes, args)
            coefficients = json.loads(Path(path).read_text())
            coefficients.pop("spread", None)  # hundreds of kB, in the profile file
            found["calibration"] = {
                "rate": rate,
                "sim_sweep": sweep,
                "profile": coefficients,
                "profile_file": path,
            }
            sweep = {layout: sim_sweep(deployment, layout, offered, args) for layout in LAYOUTS}
        factors = [float(f) for f in args.rate_factors.split(",")]
        rates = sorted({round(g * f, 4) for g in sweep.values() if g > 0 for f in factors})
        if not rates:
            raise SystemExit(f"{name}: no layout meets the SLOs even at {SWEEP_START} req/s")
        say(f"{name}: simulated goodput {_fmt(sweep)}; real rates {rates}")
        real: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}

        def serve_real(rate: float) -> None:
            """Both layouts at `rate`, interleaved: the machine's drift hits both alike."""
            for layout, system in self.systems.items():
                point = rate_point(
                    send_requests(system, offered(rate), rate, args.seed), rate, args
                )
                real[layout].append(point)
                say(f"  real {name} {layout} at {rate:g}/s: {_point_line(point)}")

        for rate in rates:
            serve_real(rate)
        for _ in range(args.lower_rates):
            lowest = rates[0]
            missed = [lay for lay in LAYOUTS if _at(real[lay], lowest) < args.attainment]
            if not missed:
                break
            rates.insert(0, round(lowest / 2, 4))
            say(f"  {', '.join(missed)} missed at {lowest:g}/s: both at {rates[0]:g}/s too")
            serve_real(rates[0])
        for points in real.values():
            points.sort(key=lambda p: p["rate"])
        sim = {
            layout: [rate_point(sim_records(deployment, layout, offered(rate), rate, args), rate, args)
                     for rate in rates]
            for layout in LAYOUTS
        }  # fmt: skip
        return _judged({**found, "sim_sweep": sweep, "rates": rates}, real, sim, args)


# Added to a workload's seeds for its calibration run: prompts no measured run sends.
CALIBRATION_SALT = 104729


def _calibration_rate(sweep: dict[str, float]) -> float:
    """The rate a workload is recorded at: the geometric mean of the layouts' simulated
    goodputs (the middle of the rates measured, on a log scale), SWEEP_START if none holds."""
    held = [g for g in sweep.values() if g > 0]
    return round(math.prod(held) ** (1 / len(held)), 4) if held else SWEEP_START


def _recorded(system: Any, requests: list, rate: float, seed: int) -> Samples:
    """The steps and pushes of `system`'s workers while it serves `requests` at `rate` (what
    they recorded before is dropped: the real runs between calibrations)."""
    system.call(take_samples)
    send_requests(system, requests, rate, seed)
    return system.call(take_samples)


def _joined(a: Samples, b: Samples) -> Samples:
    return Samples(a.steps + b.steps, a.transfers + b.transfers, a.gaps + b.gaps)


def _fit_profile(samples: Samples, path: str, model_dir: Path) -> str:
    """Fits the profile on the steps of `samples`, writes it to `path`; its summary line."""
    from pdserve.bench.engine.step_recorder import write_profile

    return write_profile(samples.steps, path, every_sample=True, gaps=samples.gaps,
                         device="cpu", model=str(model_dir))  # fmt: skip


def _at(points: list[dict], rate: float) -> float:
    return next(p["attainment"] for p in points if p["rate"] == rate)


def _workload_requests(name: str, model_config: dict, n: int, seed: int) -> list:
    from pdserve.workloads.datasets import generate_requests

    requests = generate_requests(
        CPU_WORKLOADS[name], n, seed, model_config["vocab_size"], eos_ids(model_config)
    )
    for r in requests:
        r.tag = r.tag or name
    return requests


def _router(layout: str, args: argparse.Namespace) -> dict:
    return {
        "disaggregate": LAYOUTS[layout][2],
        "progress_timeout_s": PROGRESS_TIMEOUT_S,
        "ttft_slo_ms": args.slo_ttft_ms,
        "tpot_slo_ms": args.slo_tpot_ms,
    }


class _InProcess:
    """A system served in this process, called as a ChildSystem is."""

    def __init__(self, app: Any) -> None:
        self.app, self.port = app, app.port

    def call(self, fn: Any) -> Any:
        return fn(self.app.app)


def _judged(found: dict, real: dict, sim: dict, args) -> dict:
    from pdserve.workloads.metrics import goodput_rate

    def curve(points: list[dict]) -> dict:
        attained = {p["rate"]: p["attainment"] for p in points}
        return {
            "goodput": goodput_rate(attained, args.attainment),
            "attainment_target": args.attainment,
            "points": points,
        }

    real_curves = {layout: curve(points) for layout, points in real.items()}
    sim_curves = {layout: curve(points) for layout, points in sim.items()}
    rank_real = rank({k: v["goodput"] for k, v in real_curves.items()}, args.tie)
    rank_sim = rank({k: v["goodput"] for k, v in sim_curves.items()}, args.tie)
    return {
        **found,
        "real": real_curves,
        "sim": sim_curves,
        "rank_real": rank_real.__dict__,
        "rank_sim": rank_sim.__dict__,
        "agree": agree(rank_real, rank_sim),
    }


def _fmt(goodputs: dict[str, float]) -> str:
    return ", ".join(f"{layout} {g:.3f} req/s" for layout, g in goodputs.items())


def _point_line(point: dict) -> str:
    return (
        f"attainment {point['attainment']:.0%}, TTFT p90 {point['ttft_p90_ms']:.0f} ms, "
        f"TPOT p90 {point['tpot_p90_ms']:.1f} ms, failed {point['failed']}"
    )
