"""`pdserve bench fidelity-worker`: one real worker's engine against a sim worker whose profile
was fitted on it, the same requests at the same arrivals (issue 49 point 6, the GPU half).

`bench fidelity` compares whole 1P+1D systems on Ray and needs Ray, Redis and gRPC; this one
needs only the engine, so it runs where those cannot be installed (a lent GPU machine reaches
no package registry). In one process:
1. the real worker: the torch engine on `--device`, run as a serving worker runs it, on its own
   thread behind `EngineLoop` (pdserve/worker/engine_loop.py), which takes requests between
   steps and streams each step's tokens to asyncio consumers; its executor is wrapped in
   `StepRecorder`. Steps one at a time (no async scheduling: a sim step models one step at a
   time), eager unless `--compile` (a compiled decode graph is built at the first step of each
   new batch size, mid-run, unless the warm-up met it);
2. calibration: after a warm-up (other requests of every workload below), it serves the mixed
   workload at `--rates` (requests never measured); every step and the gap before it fit a
   linear `--sim-profile` with its spread (`write_profile(..., every_sample=True,
   median=True)`): the typical step by least absolute error, since a GPU engine's steps stall
   now and then on the host and least squares would charge those stalls to whichever feature
   they share; the spread walks them back in;
3. the sim worker: the same engine with `SimExecutor` and that profile (time scale 1), the same
   KV pool, step budget and batch limit, behind its own `EngineLoop` in the same process;
4. the evaluation workloads (`fidelity_eval.py`: other lengths, rates and prefix sharing than
   the calibration's) are served by the real worker `--real-repeats` times around the sim's
   run; TTFT and TPOT p50/p90 of each, sim / first real run within `--tolerance`, and the sim
   against the real runs' band widened by 10 %.
Client times are taken where a worker's token stream hands a step's tokens to its consumer,
so the router's and gRPC's hops are not in them: they are the same code on both systems.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.common.local_system import (
    add_mixed_arguments,
    add_model_arguments,
    load_model,
    mixed_requests,
)
from pdserve.bench.simulation import worker_serving as serving
from pdserve.bench.simulation.fidelity_bench import (
    fidelity_table,
    ratios,
    spread_of,
    step_costs,
    summary_line,
)
from pdserve.bench.simulation.fidelity_eval import (
    add_eval_arguments,
    band_table,
    bands,
    eval_rate,
    eval_requests,
    parse_eval_workloads,
    run_order,
    within_count,
)

# What decides a run's requests and the workers' limits: kept in --json, read back by --replay.
WORKLOAD_ARGS = (
    "rates",
    "num_requests",
    "seed",
    "warm_up_requests",
    "mixed_long_fraction",
    "mixed_long_input_len",
    "mixed_long_output_len",
    "mixed_short_input_len",
    "mixed_short_output_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "num_kv_blocks",
    "eval_workloads",
    "dtype",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, preset="small")
    p.add_argument("--device", default="cpu", help="the real worker's device: cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rates", default="2,4", help="calibration rates (req/s), comma separated")
    p.add_argument("--num-requests", type=int, default=100, help="requests per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warm-up-requests",
        type=int,
        default=32,
        help="of the calibration mix and of each measured workload, other requests served "
        "before anything is recorded",
    )
    add_mixed_arguments(
        p, long_fraction=0.2, long_input=1024, long_output=16, short_input=64, short_output=64
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="step token budget")
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences per step at most")
    p.add_argument(
        "--num-kv-blocks", type=int, default=4096, help="KV blocks of both workers (16 tokens)"
    )
    add_eval_arguments(p, workloads="short,long,prefix", repeats=2, real="the real worker")
    p.add_argument(
        "--tolerance", type=float, default=0.1, help="sim/real within 1 +- this counts as agreeing"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="the real worker's decode-only steps as compiled CUDA graphs (the warm-up builds "
        "the graphs of the batch sizes it meets; still one step at a time)",
    )
    p.add_argument("--profile-out", help="keep the fitted profile in this file")
    p.add_argument(
        "--replay",
        metavar="JSON",
        help="serve only the sim worker, on the requests of this earlier --json file, judged "
        "against its real runs (a step model tried on a lent GPU's runs after the lease)",
    )
    p.add_argument("--sim-profile", help="with --replay: the sim's profile (default: the file's)")
    p.add_argument(
        "--refit",
        action="store_true",
        help="with --replay: the profile fitted now, as this bench fits, on the file's recorded "
        "calibration steps",
    )
    p.add_argument("--json", help="write both workers' summaries and the ratios to this file")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if min(args.num_requests, args.real_repeats, args.warm_up_requests) < 1:
        raise SystemExit("--num-requests, --real-repeats and --warm-up-requests must be >= 1")
    try:
        parse_eval_workloads(args.eval_workloads)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.profile_out and not Path(args.profile_out).parent.is_dir():
        raise SystemExit(f"--profile-out {args.profile_out}: no such directory")
    if args.replay and not Path(args.replay).is_file():
        raise SystemExit(f"--replay {args.replay}: no such file")
    result = asyncio.run((replay if args.replay else measure)(args, console.print))
    title = f"sim vs one real worker on {result['device']} (first real run)"
    console.print(fidelity_table(result, args.tolerance, title=title))
    if "bands" in result:
        console.print(band_table(result))
        count = result["within_band"]
        console.print(
            f"sim within the real band widened by 10%: {count['within']} of {count['of']}"
        )
    within = sum(
        abs(ratio - 1) <= args.tolerance for rows in result["ratios"].values() for ratio in
        rows.values()
    )  # fmt: skip
    total = sum(len(rows) for rows in result["ratios"].values())
    console.print(f"sim / first real run within ±{args.tolerance:.0%}: {within} of {total}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    runs = [*result["sim"].values(), *(s for r in result["real_repeats"].values() for s in r)]
    return 0 if sum(s["failed"] for s in runs) == 0 else 1


async def measure(args: argparse.Namespace, say: Callable[[str], Any] = print) -> dict:
    """Calibrates a profile on the real worker, then serves every evaluation workload on both;
    returns the summaries, ratios and bands in `bench fidelity`'s layout ("real", "sim",
    "real_repeats", "ratios", "rates", "bands", "within_band", "diagnosis"), plus the profile,
    the device and what each worker's measured steps cost."""
    from pdserve.bench.engine.step_recorder import StepRecorder, write_profile
    from pdserve.engine_config import SimConfig
    from pdserve.sim.profiles import parse_profile

    model_dir, model_config = load_model(args)
    measured, calibration, warm_up = _workloads(args, model_config)
    profile = args.profile_out or str(Path(tempfile.mkdtemp()) / "worker-profile.json")
    with contextlib.ExitStack() as stack:
        real = stack.enter_context(serving.served(serving.engine(args, model_dir)))
        kind = "compiled decode" if args.compile else "eager steps"
        say(f"[bold]real[/bold]: one torch worker on {args.device}, {kind}; calibrating")
        for rate, requests in warm_up:
            await serving.serve(real, requests, rate, args.seed)
        real.engine.executor = recorder = StepRecorder(real.engine.executor)
        spent: list[tuple[str, str, list, list]] = []  # (system, run, steps, gaps) of each run
        for rate, requests in calibration.items():
            summary = await serving.served_summary(real, requests, rate, args.seed)
            say(f"  calibration at {rate:g}/s: {summary_line(summary)}")
            spent.append(("real", f"calibration at {rate:g}/s", *recorder.take()))
        steps = [step for run in spent for step in run[2]]
        gaps = [gap for run in spent for gap in run[3]]
        notes = {"device": args.device, "model": str(model_dir), "dtype": args.dtype}
        say(write_profile(steps, profile, every_sample=True, median=True, gaps=gaps, **notes))
        sim = stack.enter_context(
            serving.served(serving.engine(args, model_dir, sim=SimConfig(profile=profile)))
        )
        for rate, requests in warm_up:
            await serving.serve(sim, requests, rate, args.seed)
        sim.engine.executor = sim_recorder = StepRecorder(sim.engine.executor)
        paced_before = serving.pacing(sim.engine)
        served = {"real": (real, recorder), "sim": (sim, sim_recorder)}
        summaries: dict[str, dict] = {}
        repeats: dict[str, list[dict]] = {name: [] for name in measured}
        for name, (rate, requests) in measured.items():
            for system in run_order(list(served), args.real_repeats):
                summary = await serving.served_summary(served[system][0], requests, rate, args.seed)
                if system == "real":
                    repeats[name].append(summary)
                else:
                    summaries[name] = summary
                say(f"  {system} {name} at {rate:g}/s: {summary_line(summary)}")
                spent.append((system, name, *served[system][1].take()))
        paced = serving.pacing(sim.engine)
    timing = parse_profile(profile)
    diagnosis = {}
    for system in served:
        measured_runs = [run for run in spent if run[0] == system and run[1] in measured]
        steps = [step for run in measured_runs for step in run[2]]
        gaps = [gap for run in measured_runs for gap in run[3]]
        diagnosis[system] = {
            "steps": step_costs(steps, timing),
            "spread": spread_of(steps, gaps, timing),
        }
    diagnosis["sim"]["pacing"] = {key: round(paced[key] - paced_before[key], 4) for key in paced}
    say(f"measured runs: {diagnosis}")
    return {
        "args": {key: getattr(args, key) for key in WORKLOAD_ARGS},
        "device": _device_name(args.device),
        "profile": json.loads(Path(profile).read_text()),
        **_judged(measured, repeats, summaries),
        "diagnosis": diagnosis,
        "runs": [
            _run_steps(system, run, steps, gaps, timing) for system, run, steps, gaps in spent
        ],
        "sample_fields": SAMPLE_FIELDS,
    }


async def replay(args: argparse.Namespace, say: Callable[[str], Any] = print) -> dict:
    """The sim worker alone, with `--sim-profile` (default: the file's own), on the requests of
    a previous run's `--json` file (`--replay`), judged against that run's real worker: a step
    model is tried against a lent GPU's real runs on any machine, after the lease."""
    from pdserve.engine_config import SimConfig

    previous = {**json.loads(Path(args.replay).read_text()), "replayed_from": args.replay}
    for key, value in previous.get("args", {}).items():
        setattr(args, key, value)  # the requests and limits of that run
    model_dir, model_config = load_model(args)
    measured, _, warm_up = _workloads(args, model_config)
    rates = {name: rate for name, (rate, _) in measured.items()}
    if rates != previous["rates"]:
        raise SystemExit(
            f"--replay {args.replay}: measured {previous['rates']}, these args {rates}"
        )
    profile = args.sim_profile
    if args.refit:
        profile = str(Path(tempfile.mkdtemp()) / "refitted-profile.json")
        say(_refit(previous, profile))
    elif not profile:
        profile = str(Path(tempfile.mkdtemp()) / "replayed-profile.json")
        Path(profile).write_text(json.dumps(previous["profile"]), encoding="utf-8")
    summaries = {}
    with serving.served(serving.engine(args, model_dir, sim=SimConfig(profile=profile))) as sim:
        for rate, requests in warm_up:
            await serving.serve(sim, requests, rate, args.seed)
        for name, (rate, requests) in measured.items():
            summaries[name] = await serving.served_summary(sim, requests, rate, args.seed)
            say(f"  sim {name} at {rate:g}/s: {summary_line(summaries[name])}")
    return {
        "replayed_from": args.replay,
        "device": previous["device"],
        "profile": json.loads(Path(profile).read_text()),
        **_judged(measured, previous["real_repeats"], summaries),
    }


def _refit(previous: dict, path: str) -> str:
    """Fits the recorded calibration steps of a `--json` file as this bench fits them now
    (`write_profile`, median fit, spread) into `path`; returns write_profile's summary. The
    linear model reads only a step's totals, which the samples hold, so the fit is exact."""
    from pdserve.bench.engine.step_recorder import write_profile

    fields = previous.get("sample_fields", SAMPLE_FIELDS[:3] + SAMPLE_FIELDS[-2:])
    recorded = [
        dict(zip(fields, sample, strict=True))
        for run in previous.get("runs", [])
        if run["system"] == "real" and run["run"].startswith("calibration")
        for sample in run["samples"]
    ]
    if not recorded:
        raise SystemExit(f"--refit: {previous['replayed_from']} holds no calibration steps")
    steps = [(_work_of(sample), sample["ms"] / 1e3) for sample in recorded]
    gaps = [sample["ms of gap before it"] / 1e3 for sample in recorded]
    notes = {key: previous["profile"][key] for key in ("device", "model", "dtype")}
    return write_profile(steps, path, every_sample=True, median=True, gaps=gaps, **notes)


def _work_of(sample: dict) -> Any:
    """A StepWork with a sample's totals: its prompt chunks (one, in files from before chunks
    were recorded) and decode sequences, the context beyond the prompt tokens shared among the
    decodes (or, with none, before the first chunk)."""
    from pdserve.sim.timing import Chunk, StepWork

    prompt, decodes = sample["prompt tokens"], sample["decode sequences"]
    count = sample.get("prompt chunks", 1 if prompt else 0)
    context = sample["context tokens"] - prompt
    chunks = [
        Chunk(
            context if i == 0 and not decodes else 0, prompt // count + (i < prompt % count), False
        )
        for i in range(count)
    ]
    chunks += [
        Chunk(context // decodes + (i < context % decodes) - 1, 1, True) for i in range(decodes)
    ]
    return StepWork.of(chunks, decodes + count)


def _judged(measured: dict, repeats: dict[str, list[dict]], sims: dict[str, dict]) -> dict:
    """Rates, the real runs (the first and all), the sim's, sim / first real run, and from two
    real runs the bands."""
    first_real = {name: runs[0] for name, runs in repeats.items()}
    judged = {
        "rates": {name: rate for name, (rate, _) in measured.items()},
        "real": first_real,
        "real_repeats": repeats,
        "sim": sims,
        "ratios": {name: ratios(first_real[name], sims[name]) for name in measured},
    }
    if min(len(runs) for runs in repeats.values()) >= 2:
        judged["bands"] = {name: bands(runs, sims[name]) for name, runs in repeats.items()}
        judged["within_band"] = within_count(judged["bands"])
    return judged


def _run_steps(system: str, run: str, steps: list, gaps: list[float], timing: Any) -> dict:
    """One run's steps: their measured seconds against the profile's, and (the real worker's)
    every step as SAMPLE_FIELDS, so another step model can be fitted and judged on them
    afterwards."""
    steps_of_run = {"system": system, "run": run, **step_costs(steps, timing)}
    if system == "real":
        steps_of_run["samples"] = [_sample(w, s, g) for (w, s), g in zip(steps, gaps, strict=True)]
    return steps_of_run


SAMPLE_FIELDS = (
    "prompt tokens",
    "decode sequences",
    "context tokens",
    "prompt chunks",
    "longest prompt chunk",
    "ms",
    "ms of gap before it",
)


def _sample(work: Any, seconds: float, gap: float) -> list:
    prompt_chunks = [chunk.new for chunk in work.chunks if not chunk.decode]
    return [
        work.prefill_tokens,
        work.decode_seqs,
        work.context_tokens,
        len(prompt_chunks),
        max(prompt_chunks, default=0),
        round(seconds * 1e3, 3),
        round(gap * 1e3, 3),
    ]


def _workloads(args: argparse.Namespace, model_config: dict) -> tuple:
    """({workload: (rate, requests)} measured, {rate: requests} of the calibration, [(rate,
    requests)] of the warm-up): the same arguments give the same requests."""
    rates = [float(r) for r in args.rates.split(",")]
    names = parse_eval_workloads(args.eval_workloads)
    measured = {
        name: (eval_rate(name, rates), eval_requests(name, model_config, args.num_requests,
                                                     args.seed + 100 + i))
        for i, name in enumerate(names)
    }  # fmt: skip
    calibration = {
        rate: mixed_requests(args, model_config, args.num_requests, args.seed + i)
        for i, rate in enumerate(rates)
    }
    # Other requests of the calibration mix and of every measured workload, each at its rate:
    # what a GPU engine pays the first time it meets a shape (kernel selection, compilations,
    # the allocator growing) is paid before anything is recorded, as in a server that has
    # served such traffic before.
    warm_up = [
        (max(rates), mixed_requests(args, model_config, args.warm_up_requests, args.seed + 7_000))
    ]
    warm_up += [
        (rate, eval_requests(name, model_config, args.warm_up_requests, args.seed + 7_001 + i))
        for i, (name, (rate, _)) in enumerate(measured.items())
    ]
    return measured, calibration, warm_up


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"
