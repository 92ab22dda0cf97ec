"""`pdserve plan`: how many prefill and decode workers (or colocated) serve a workload best
within TTFT/TPOT targets, predicted offline on a virtual clock (pdserve/planner, docs/planner.md).

Every split of the GPUs is searched for its goodput: the highest request rate at which at
least 90% of the requests meet both targets. The best few are printed with their predicted
latencies and GPU utilisation, and the recommendation is "colocated" when disaggregating gains
no more than the search's precision.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from pdserve.commands import CommandError
from pdserve.commands.arg_types import bounded
from pdserve.config import ROUTING_POLICIES

GPUS = ("a100", "h100", "h200", "l40s")  # pdserve/sim/gpus.py (not imported: --help stays fast)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        metavar="CONFIG",
        help="model directory (config.json + tokenizer; weights not needed) or a shape: "
        "llama-3.1-8b, llama-3.1-70b",
    )
    parser.add_argument(
        "--gpu", default="h100", help=f"GPU of the analytical profile ({', '.join(GPUS)})"
    )
    parser.add_argument("--gpus", type=bounded(int, minimum=1), required=True, help="GPUs to split")
    parser.add_argument(
        "--tp",
        type=bounded(int, minimum=1),
        default=1,
        help="tensor parallel GPUs per worker, both pools (default: 1)",
    )
    parser.add_argument(
        "--prefill-tp",
        type=_positive_ints,
        metavar="N[,N...]",
        help="TPs the prefill pool's workers may have, e.g. 1,2,4 (default: --tp)",
    )
    parser.add_argument(
        "--decode-tp",
        type=_positive_ints,
        metavar="N[,N...]",
        help="TPs the decode (and colocated) workers may have (default: --tp)",
    )
    parser.add_argument(
        "--workload",
        required=True,
        metavar="FILE|PRESET",
        help="chat, rag, mixed, or a JSONL file of [prompt_len, output_len(, arrival_s)]",
    )
    parser.add_argument("--ttft-slo-ms", type=bounded(float, above=0), required=True)
    parser.add_argument("--tpot-slo-ms", type=bounded(float, above=0), required=True)
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="timing profile (--sim-profile syntax; default analytical:GPU:tpN)",
    )
    parser.add_argument(
        "--requests",
        type=bounded(int, minimum=1),
        default=10_000,
        help="requests of a preset workload (default: 10000)",
    )
    parser.add_argument(
        "--requests-per-worker",
        type=bounded(int, minimum=10),
        default=500,
        help="requests a rate probe offers per simulated worker (default: 500; at most the "
        "workload)",
    )
    parser.add_argument(
        "--attainment",
        type=bounded(float, above=0, maximum=1),
        default=0.9,
        help="fraction of requests that must meet both SLOs (default: 0.9)",
    )
    parser.add_argument(
        "--precision",
        type=bounded(float, above=0),
        default=0.05,
        help="bisection stops when the goodput is known within this fraction (default: 0.05)",
    )
    parser.add_argument("--top", type=bounded(int, minimum=1), default=3, help="splits to print")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--max-num-seqs", type=bounded(int, minimum=1), default=256)
    # vLLM's step budget on 80 GB-class GPUs, as the sim benchmarks use (pdserve/bench/simulation/sim_run.py).
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive_ints,
        default=[8192],
        metavar="N[,N...]",
        help="step token budgets (the prefill chunk) to search, e.g. 224,2048: every split at "
        "each, kept at its best (default: 8192). Under a tight TPOT colocated workers serve most "
        "with small chunks and prefill workers with large ones: one budget for both compares a "
        "split with an untuned colocated baseline",
    )
    parser.add_argument(
        "--link-gbps",
        type=bounded(float, above=0),
        default=400.0,
        help="prefill-to-decode KV link per worker, Gbit/s (default: 400)",
    )
    parser.add_argument("--policy", default="cost", choices=ROUTING_POLICIES)
    parser.add_argument("--disaggregate", default="auto", choices=("auto", "always", "never"))
    parser.add_argument(
        "--jobs",
        type=bounded(int, minimum=1),
        default=_usable_cpus(),
        help="processes that search splits in parallel (default: the usable CPUs, "
        f"{_usable_cpus()} here; the plan is the same for any number)",
    )
    parser.add_argument(
        "--bracket-runners-up",
        action="store_true",
        help="faster: a disaggregated split known to fall below the best goodput found is left "
        "as a bracket instead of searched within --precision (the recommendation is the same unless "
        "the best splits lie within the precision of each other)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and probe sample seed")
    parser.add_argument("--json", metavar="FILE", help="also write every split's result here")
    parser.add_argument("--time", action="store_true", help="print the search's wall time")
    parser.add_argument("--verbose", action="store_true", help="print every probe")


def run(args: argparse.Namespace) -> int:
    from pdserve.planner.report import plan_json, plan_table

    started = time.perf_counter()
    plan, context = _plan(args)
    print(plan_table(plan, context, args.top))
    if args.time:
        print(
            f"time: {time.perf_counter() - started:.1f} s in all, search {plan.seconds:.1f} s, "
            f"{plan.probes} probes; CPU {_cpu_seconds():.1f} s in {args.jobs} jobs; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(plan_json(plan, context), indent=2) + "\n")
        except OSError as e:
            raise CommandError(f"--json {args.json}: {e.strerror or e}") from e
    return 0


def _plan(args: argparse.Namespace):
    from pdserve.config import RouterConfig
    from pdserve.planner.ceiling import compute_ceiling
    from pdserve.planner.deployment import Deployment, PoolDeployments
    from pdserve.planner.probe import SLO
    from pdserve.planner.search import (
        Search,
        sampled_requests_per_worker,
        steady_requests_per_worker,
    )
    from pdserve.planner.splits import tp_splits
    from pdserve.planner.workload import load_workload, probe_sample
    from pdserve.sim.profiles import ProfileError

    if args.gpu.lower() not in GPUS:
        raise CommandError(f"--gpu: unknown GPU {args.gpu!r} (known: {', '.join(GPUS)})")
    prefill_tps, decode_tps = args.prefill_tp or [args.tp], args.decode_tp or [args.tp]
    per_pool = args.prefill_tp is not None or args.decode_tp is not None
    if not per_pool and args.gpus % args.tp:
        raise CommandError(f"--gpus {args.gpus} is not a multiple of --tp {args.tp}")
    if per_pool and args.profile and len({*prefill_tps, *decode_tps}) > 1:
        raise CommandError(
            "--profile times every worker alike: give one TP (--tp) with it, or leave it out "
            "(each TP gets analytical:GPU:tpN)"
        )
    splits = tp_splits(args.gpus, prefill_tps, decode_tps)
    if not splits:
        raise CommandError(
            f"--gpus {args.gpus} holds no worker of --prefill-tp {_tps(prefill_tps)} "
            f"/ --decode-tp {_tps(decode_tps)}"
        )
    budgets = list(dict.fromkeys(args.max_num_batched_tokens))
    try:
        by_budget = {
            budget: {
                tp: Deployment(
                    args.model,
                    gpu=args.gpu,
                    tp=tp,
                    profile=args.profile,
                    dtype=args.dtype,
                    link_gbps=args.link_gbps,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=budget,
                )
                for tp in sorted({*prefill_tps, *decode_tps})
            }
            for budget in budgets
        }
    except ProfileError as e:
        raise CommandError(f"--profile: {_one_line(e)}") from None
    except (ValueError, KeyError, OSError) as e:
        raise CommandError(_one_line(e)) from None
    deployments = by_budget[budgets[0]]
    deployment = deployments[min(decode_tps)]
    workers = max(s.prefill + s.decode for s in splits)  # the most any probe may simulate
    try:
        workload = load_workload(args.workload, args.requests, args.seed)
    except ValueError as e:
        raise CommandError(_one_line(e)) from None
    too_long = [r for r in workload if r.prompt_len + r.output_len > deployment.max_model_len]
    if too_long:
        raise CommandError(
            f"--workload: {len(too_long)} requests exceed the context of {deployment.max_model_len} "
            f"tokens (the first: prompt {too_long[0].prompt_len} + output {too_long[0].output_len})"
        )
    per_worker = sampled_requests_per_worker(deployment, args.requests_per_worker)
    sample = probe_sample(workload, min(per_worker * workers, len(workload)), args.seed)
    slo = SLO(args.ttft_slo_ms, args.tpot_slo_ms, args.attainment)
    router = RouterConfig(
        policy=args.policy,
        disaggregate=args.disaggregate,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        max_pending_requests=max(RouterConfig().max_pending_requests, len(sample)),
    )
    on_probe = _print_probe if args.verbose else None
    plans = []
    for budget, at_budget in by_budget.items():
        search = Search(
            at_budget[min(decode_tps)],
            sample,
            slo,
            router,
            precision=args.precision,
            top=args.top,
            requests_per_worker=args.requests_per_worker,
            on_probe=on_probe,
            jobs=args.jobs,
            rank_all=not args.bracket_runners_up,
            deployment_for=PoolDeployments(at_budget),
        )
        plans.append(search.run(splits))
        if len(budgets) > 1:
            for result in plans[-1].results:
                result.max_num_batched_tokens = budget
    plan = _best_per_split(plans)
    context = {
        "model": args.model,
        "gpu": deployment.gpu,
        "gpus": args.gpus,
        "tp": args.tp
        if not per_pool
        else f"prefill {_tps(prefill_tps)}, decode {_tps(decode_tps)}",
        "profile": deployment.profile if len(deployments) == 1 else "analytical:GPU:tpN per pool",
        "workload": args.workload,
        "requests": len(workload),
        "requests_per_worker": args.requests_per_worker,
        "steady_requests_per_worker": steady_requests_per_worker(deployment),
        "ttft_slo_ms": args.ttft_slo_ms,
        "tpot_slo_ms": args.tpot_slo_ms,
        "attainment": args.attainment,
        "max_num_batched_tokens": budgets,
        # FLOPs / (tp x peak) per worker: the same ceiling at any TP, from the smallest.
        "compute_ceiling": compute_ceiling(
            deployments[min(deployments)], sample, args.gpus // min(deployments)
        ),
    }
    return plan, context


def _positive_ints(text: str) -> list[int]:
    """`1,2,4`: the TPs a pool's workers may have, or the step budgets to search."""
    parse = bounded(int, minimum=1)
    return [parse(part) for part in text.split(",")]


def _best_per_split(plans):
    """One plan of each split at the step budget it served most at (the first budget given
    at equal goodputs): point 0 of issue 49, each layout against its own best setting."""
    from pdserve.planner.search import Plan, ranked

    best = {}
    for plan in plans:
        for result in plan.results:
            if result.split not in best or result.goodput > best[result.split].goodput:
                best[result.split] = result
    return Plan(
        ranked(list(best.values())),
        plans[0].precision,
        sum(p.seconds for p in plans),
        sum(p.probes for p in plans),
    )


def _tps(tps: list[int]) -> str:
    return ",".join(map(str, tps))


def _print_probe(probe) -> None:
    verdict = "pass" if probe.passed else "fail"
    print(
        f"  probe {probe.split.name:>14} at {probe.rate:9.2f} req/s: {verdict} "
        f"({probe.good} met, {probe.missed} missed of {probe.requests})",
        flush=True,
    )


def _cpu_seconds() -> float:
    """User + system CPU of this process and its ended children (the search's workers)."""
    import resource

    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _one_line(error: BaseException) -> str:
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(text.split())
