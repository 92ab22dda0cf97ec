"""`pdserve bench sim-memory`: how much memory a sim worker takes, against a torch one, and
whether 64 sim workers fit on this machine (issue 14 point 4).

Three systems, one after the other, each serving a few mixed requests before it is measured:
1P+1D torch workers, 1P+1D sim workers, and `--many` sim workers (half prefill, half decode)
started together. For every worker actor process: its RSS now, its peak RSS (the kernel's
high-water mark, VmHWM) and whether `torch` is in its `sys.modules`. For the many-worker
system also the whole: every process of this run (Ray's GCS, raylet and idle workers, Redis,
the router in this process) by RSS and by PSS (shared pages counted once, split among sharers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
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

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, preset="small")
    p.add_argument("--many", type=int, default=64, help="sim workers started together")
    p.add_argument("--num-requests", type=int, default=8, help="requests served per system")
    p.add_argument(
        "--sim-time-scale", type=float, default=1.0, help="of the sim workers (wall per sim s)"
    )
    add_mixed_arguments(
        p, long_fraction=0.25, long_input=512, long_output=8, short_input=64, short_output=16
    )
    p.add_argument("--json", help="write the measurements to this file")


def _actor_facts(actor: Any) -> dict:
    """Runs in a worker actor: its pid, RSS and peak RSS in bytes, and whether torch is loaded."""
    import psutil

    rss = psutil.Process().memory_info().rss
    return {
        "pid": os.getpid(),
        "rss": rss,
        # The kernel syncs its per-thread RSS counters into VmHWM lazily, so the high-water
        # mark can read a few pages below an RSS read just before it (seen: 8 KiB).
        "peak_rss": max(_peak_rss(), rss),
        "torch": "torch" in sys.modules,
    }


def _peak_rss() -> int:
    """VmHWM of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker_facts(app: Any) -> dict[str, dict]:
    """{worker_id: facts} of every worker of the served `app` (a ServingApp)."""
    import ray

    workers = list(app.pool.workers.values())
    facts = ray.get([w.actor.__ray_call__.remote(_actor_facts) for w in workers], timeout=120)
    return {w.worker_id: f for w, f in zip(workers, facts, strict=True)}


def run_memory() -> dict[str, float]:
    """RSS and PSS (bytes) summed over this process and all its descendants: with a local
    Ray that is the whole served system."""
    import psutil

    me = psutil.Process()
    rss = pss = 0
    count = 0
    for process in [me, *me.children(recursive=True)]:
        try:
            info = process.memory_full_info()
        except psutil.Error:  # ended meanwhile
            continue
        rss, pss, count = rss + info.rss, pss + info.pss, count + 1
    return {"processes": count, "rss": rss, "pss": pss}


def measure(args: argparse.Namespace, say: Any = print) -> dict:
    from pdserve.engine_config import SimConfig

    model_dir, model_config = load_model(args)
    requests = mixed_requests(args, model_config, args.num_requests, seed=0)
    sim = {"kind": "sim", "sim": SimConfig(time_scale=args.sim_time_scale)}
    many_prefill = args.many // 2
    start_ray(max(many_prefill, 1), args.many - many_prefill)
    systems = {
        "torch 1P+1D": (1, 1, {}),
        "sim 1P+1D": (1, 1, sim),
        f"sim {args.many} workers": (many_prefill, args.many - many_prefill, sim),
    }
    result = {}
    for name, (prefill, decode, engine) in systems.items():
        say(f"[bold]{name}[/bold]: starting and serving {len(requests)} requests")
        with serve_locally(
            model_dir, prefill_workers=prefill, decode_workers=decode, engine=engine
        ) as app:
            asyncio.run(_serve(app.port, requests))
            result[name] = {"workers": worker_facts(app.app), "system": run_memory()}
        say(summary_line(name, result[name]))
    return result


async def _serve(port: int, requests: list) -> None:
    from pdserve.bench.common.load_generator import run_load

    records = await run_load(f"127.0.0.1:{port}", requests, max_concurrency=4)
    failed = [r for r in records if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(records)} requests failed: {failed[0]}")


def summary_line(name: str, measured: dict) -> str:
    workers = measured["workers"].values()
    rss = sorted(w["rss"] for w in workers)
    peak = max(w["peak_rss"] for w in workers)
    with_torch = sum(w["torch"] for w in workers)
    system = measured["system"]
    return (
        f"  {len(rss)} workers: RSS median {rss[len(rss) // 2] / MiB:.0f} MiB, "
        f"sum {sum(rss) / MiB:.0f} MiB, peak of one {peak / MiB:.0f} MiB; torch loaded in "
        f"{with_torch}; whole run ({system['processes']} processes): "
        f"RSS {system['rss'] / MiB:.0f} MiB, PSS {system['pss'] / MiB:.0f} MiB"
    )


def run(args: argparse.Namespace) -> int:
    if args.many < 2 or args.num_requests < 1:
        raise SystemExit("--many must be >= 2 and --num-requests >= 1")
    from rich.console import Console

    result = measure(args, Console().print)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
