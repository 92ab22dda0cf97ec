"""`pdserve bench control-plane`: the router and the Redis prefix index at cluster scale.

    pdserve bench control-plane                      # 256 workers, >= 1M indexed blocks

    pdserve bench control-plane --workload tenants --workers 64   # issue 50's tenants

A private redis-server is filled with the index of `--workers` workers through the workers' own
publisher (`--fill bulk`: each worker's block set in one resync, ~35 s per 1M blocks; `--fill
events`: sim engines' KV events step by step, ~430 s; control_plane_fill.py), with system
prompts cached on many workers and conversation histories on one to three, or tenants' prefixes
on their 1-3 home workers with their users' conversations (control_plane_workload.py). Then the router's routing decision (`Routing.choose`: hashing,
the lookup, the policy over every worker's load) is timed for `--prompt-tokens` prompts, one at
a time, with KV events flowing (control_plane_churn.py) and with concurrent requests on one
event loop (control_plane_routing.py), for each `--lookup`: the Redis script, or the router's
copy of the index (pdserve/prefix_index/mirror.py); and
the publishing load of one prefill and one decode worker is measured at stated token rates
(control_plane_events.py). Reported: decision latency p50/p99 and its parts, decisions/s,
Redis memory per indexed block, Redis commands and bytes per worker per second, peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from pdserve.bench.control_plane.control_plane_workload import PlanSettings
from pdserve.config import ROUTING_POLICIES

P99_TARGET_MS = 1.0
# Each workload's shape where a flag does not set it: (prompt tokens, system prompts, system
# tokens, a conversation's own tokens at least). tenants: 4096-token prefixes (issue 50's), a
# history of 1-27 turns of 64-token questions and answers; at 1M blocks ~2,000 tenants with
# ~12 conversations each.
WORKLOAD_DEFAULTS = {
    "conversations": (4096, 64, 1024, 512),
    "tenants": (4096 + 512, 2048, 4096, 128),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--prefill-workers", type=int, default=64, help="of --workers; the rest decode")
    p.add_argument("--blocks", type=int, default=1_000_000, help="distinct blocks to index")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--workload",
        choices=tuple(WORKLOAD_DEFAULTS),
        default="conversations",
        help="what the index holds and the prompts routed (control_plane_workload.py): "
        "conversations on a few shared system prompts, or issue 50's tenants (long prefixes, "
        "each with a few users' short conversations on its home workers)",
    )
    p.add_argument("--prompt-tokens", type=int, help="length of routed prompts")
    p.add_argument("--system-prompts", type=int, help="system prompts, or tenants' prefixes")
    p.add_argument("--system-tokens", type=int, help="tokens of each system prompt or prefix")
    p.add_argument("--min-history-tokens", type=int, help="a conversation's own tokens, at least")
    p.add_argument(
        "--fill",
        choices=("bulk", "events"),
        default="bulk",
        help="bulk: each worker's block set written in one resync (seconds per 1M blocks); "
        "events: sim engines compute the prompts and publish their KV events step by step",
    )
    p.add_argument("--decisions", type=int, default=1000, help="timed decisions, mode never")
    p.add_argument(
        "--pair-decisions",
        type=int,
        default=200,
        help="timed decisions of the modes that estimate every prefill x decode pair",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of routed requests")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--disaggregate",
        default="never,auto",
        help="comma-separated modes, each timed: never (each worker prefills its own requests: "
        "one option per worker), auto or always (every prefill x decode pair too)",
    )
    p.add_argument(
        "--lookup",
        default="redis,mirror",
        help="comma-separated, each timed: redis (one lookup script call per decision) or "
        "mirror (the router's copy of the index, pdserve/prefix_index/mirror.py)",
    )
    p.add_argument(
        "--churn-blocks-per-s",
        type=float,
        default=20_000.0,
        help="KV event load while the decisions are timed again: blocks stored and evicted per "
        "second by extra publishers in a child process (0: skip that pass)",
    )
    p.add_argument("--policy", default="cost", choices=ROUTING_POLICIES)
    p.add_argument("--fill-processes", type=int, default=2)
    p.add_argument(
        "--events-seconds",
        type=float,
        default=10.0,
        help="wall seconds of the publishing-load measurement (0: skip it)",
    )
    p.add_argument("--decode-tok-s-per-seq", type=float, default=40.0)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--prefill-tok-s", type=float, default=10_000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure to this file")


def run(args: argparse.Namespace) -> int:
    modes = args.disaggregate.split(",")
    if not set(modes) <= {"auto", "always", "never"}:
        raise SystemExit(
            f"--disaggregate: expected auto, always or never, got {args.disaggregate!r}"
        )
    if not set(args.lookup.split(",")) <= {"redis", "mirror"}:
        raise SystemExit(f"--lookup: expected redis or mirror, got {args.lookup!r}")
    try:
        prompt, systems, system_tokens, history = WORKLOAD_DEFAULTS[args.workload]
        settings = PlanSettings(
            workers=args.workers,
            prefill_workers=args.prefill_workers,
            target_blocks=args.blocks,
            block_size=args.block_size,
            prompt_tokens=args.prompt_tokens or prompt,
            system_prompts=args.system_prompts or systems,
            system_tokens=args.system_tokens or system_tokens,
            min_history_tokens=args.min_history_tokens or history,
            seed=args.seed,
            layout=args.workload,
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    report = measure(settings, args)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


def measure(settings: PlanSettings, args: argparse.Namespace) -> dict[str, Any]:
    """Runs every phase against one private redis-server; returns the report (a plain dict)."""
    import redis

    from pdserve.bench.control_plane.control_plane_fill import (
        MODEL_NAME,
        bulk_fill_index,
        fill_index,
    )
    from pdserve.bench.control_plane.control_plane_workload import IndexPlan
    from pdserve.prefix_index.redis_server import RedisServer

    plan = IndexPlan.build(settings)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        before = _redis_counters(client)
        start = time.perf_counter()
        if args.fill == "bulk":
            fills, fill_rss = bulk_fill_index(plan, server.url), 0
        else:
            fills, fill_rss = fill_index(settings, server.url, processes=args.fill_processes)
        fill_s = time.perf_counter() - start
        after = _redis_counters(client)
        report: dict[str, Any] = {
            "settings": dataclasses.asdict(settings),
            "index": index_report(client, MODEL_NAME, plan, fills, before, after),
            "fill": {"how": args.fill, "seconds": fill_s, "process_peak_rss_mb": fill_rss / 1e6},
        }
        report["routing"] = [
            routing_report(plan, server.url, args, mode, lookup)
            for mode in args.disaggregate.split(",")
            for lookup in args.lookup.split(",")
        ]
        if args.events_seconds > 0:
            from pdserve.bench.control_plane.control_plane_events import (
                EventLoad,
                measure_publishing,
            )

            load = EventLoad(
                block_size=settings.block_size,
                decode_batch=args.decode_batch,
                decode_tok_s_per_seq=args.decode_tok_s_per_seq,
                prefill_tok_s=args.prefill_tok_s,
                seconds=args.events_seconds,
            )
            report["publishing"] = measure_publishing(load)
        report["memory"] = {
            "redis_rss_mb": _rss_mb(server.pid, "VmRSS"),
            "redis_peak_rss_mb": _rss_mb(server.pid, "VmHWM"),
            "redis_used_memory_peak_mb": client.info("memory")["used_memory_peak"] / 1e6,
            "router_process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
            "fill_process_peak_rss_mb": fill_rss / 1e6,
        }
        client.close()
    report["load_average"] = Path("/proc/loadavg").read_text().split()[:3]
    return report


def index_report(client, model: str, plan, fills, before: dict, after: dict) -> dict[str, Any]:
    """What the index holds, checked against what the engines published and the plan."""
    from pdserve.prefix_index.schema import IndexKeys

    keys = IndexKeys(model)
    block_keys, entries = _count_blocks(client, keys.block_prefix)
    stored = sum(f.stored_blocks for f in fills)
    planned = sum(plan.held_blocks(w) for w in range(plan.settings.workers))
    memory = after["used_memory"] - before["used_memory"]
    commands = after["total_commands_processed"] - before["total_commands_processed"]
    received = after["total_net_input_bytes"] - before["total_net_input_bytes"]
    return {
        "distinct_blocks": block_keys,
        "planned_distinct_blocks": plan.distinct_blocks,
        "entries": entries,  # (block, worker) pairs
        "stored_blocks_published": stored,
        "removed_blocks_published": sum(f.removed_blocks for f in fills),
        "planned_entries": planned,
        "failed_publishes": sum(f.failed_publishes for f in fills),
        "publishes": sum(f.publishes for f in fills),
        "conversations": len(plan.conversations),
        "used_memory_mb": memory / 1e6,
        "bytes_per_block": memory / max(1, block_keys),
        "bytes_per_entry": memory / max(1, entries),
        "fill_commands_per_stored_block": commands / max(1, stored),
        "fill_bytes_in_per_stored_block": received / max(1, stored),
    }


def routing_report(
    plan, redis_url: str, args: argparse.Namespace, mode: str, lookup: str
) -> dict[str, Any]:
    from pdserve.bench.control_plane.control_plane_churn import Churn, ChurnProcess
    from pdserve.bench.control_plane.control_plane_fill import MODEL_NAME
    from pdserve.bench.control_plane.control_plane_routing import (
        LoadSettings,
        concurrent_decisions,
        threaded_lookups,
        time_decisions,
        time_lookups,
        worker_pool,
    )
    from pdserve.bench.control_plane.control_plane_workload import probes
    from pdserve.config import RouterConfig
    from pdserve.core.block_hash import prompt_block_hashes
    from pdserve.heap import freeze_startup_heap
    from pdserve.prefix_index.lookup import PrefixIndex
    from pdserve.workloads.metrics import LatencyStats
    from router.policy import RoutingPolicy
    from router.routing import Routing

    bs = plan.settings.block_size
    count = args.decisions if mode == "never" else args.pair_decisions
    prompts = probes(plan, count, seed=args.seed + 1)
    rss_before, built = _rss_mb(os.getpid(), "VmRSS"), time.perf_counter()
    index = PrefixIndex(redis_url, MODEL_NAME, bs, mirror=lookup == "mirror")
    mirror = None
    if index.mirror is not None:
        if not index.mirror.wait_caught_up(timeout_s=600):
            raise SystemExit("the index mirror did not build within 600 s")
        mirror = {
            "build_s": time.perf_counter() - built,
            "rss_mb": _rss_mb(os.getpid(), "VmRSS") - rss_before,  # what the copy added
        }
    config = RouterConfig(policy=args.policy, disaggregate=mode, max_pending_requests=1 << 30)

    def routing() -> Routing:
        pool = worker_pool(plan, LoadSettings(), args.seed, colocated=mode == "never")
        return Routing(pool, RoutingPolicy(config), bs, index)

    async def decide() -> tuple:
        warm = routing()
        await warm.pool.poll_once()
        for probe in prompts[:10]:  # import, first-call and connection costs are not per decision
            await warm.choose_async(probe.prompt, args.max_tokens, set())
        # As `pdserve serve` does once its router has started (pdserve/heap.py); here the
        # frozen heap also holds this bench's plan of the index, which no router holds.
        freeze_startup_heap("control-plane bench")
        times = await time_decisions(routing(), prompts, args.max_tokens, poll_every=64)
        churned = None
        if args.churn_blocks_per_s > 0:
            churn = Churn(redis_url, MODEL_NAME, bs, blocks_per_s=args.churn_blocks_per_s)
            applied = index.mirror.events if index.mirror is not None else 0
            with ChurnProcess(churn) as flowing:
                churned = await time_decisions(routing(), prompts, args.max_tokens, 64)
                rate = flowing.blocks_per_s()
            applied = (index.mirror.events - applied) if index.mirror is not None else 0
            churned = (churned, rate, applied / churned.wall_s)
        # Decisions share one event loop and await their Redis round trips without holding
        # it: the loop's work per decision bounds the rate, which a few hundred show.
        rate = await concurrent_decisions(
            routing(), prompts[:300], args.max_tokens, args.concurrency
        )
        await index.link.aclose()  # this loop's asyncio client; the lookups below are sync
        return times, rate, churned

    times, concurrent_rate, churned = asyncio.run(decide())
    time_lookups(index, prompts, bs, times)
    chains = [prompt_block_hashes(p.prompt, bs) for p in prompts]
    lookup_rate = threaded_lookups(index, chains, args.concurrency)
    index.close()
    total = LatencyStats.of(times.total)
    workers, prefill = plan.settings.workers, plan.settings.prefill_workers
    pairs = prefill * (workers - prefill)
    return {
        "lookup": lookup,
        "mirror": mirror,
        "decisions": len(times.total),
        "workers": plan.settings.workers,
        "policy": args.policy,
        "disaggregate": mode,
        # Options the policy estimates per request. never: all workers colocated, each one an
        # option; auto: each prefill x decode pair and each decode worker alone; always: pairs.
        "options": {"never": workers, "auto": pairs + workers - prefill, "always": pairs}[mode],
        "decision_ms": dataclasses.asdict(total),
        "decision_cpu_ms": dataclasses.asdict(LatencyStats.of(times.cpu)),
        "redis_cpu_per_lookup_ms": times.redis_cpu_per_lookup_s * 1e3,
        "hashing_ms": dataclasses.asdict(LatencyStats.of(times.hashing)),
        "lookup_ms": dataclasses.asdict(LatencyStats.of(times.lookup)),
        "p99_target_ms": P99_TARGET_MS,
        "p99_met": total.p99 <= P99_TARGET_MS,
        "decisions_per_s": len(times.total) / times.wall_s,
        "decisions_per_s_concurrent": concurrent_rate,
        "concurrency": args.concurrency,
        "lookups_per_s_threads": lookup_rate,
        "rejected": times.rejected,
        "lookup_mismatches": times.lookup_mismatches,
        "longest_holder_chosen": times.longest_holder_chosen,
        "prompts_with_holder": times.with_holder,
        "with_events": None
        if churned is None
        else {
            "decision_ms": dataclasses.asdict(LatencyStats.of(churned[0].total)),
            # Against wall time: what the decisions waited for (a core, the GIL) with events.
            "decision_cpu_ms": dataclasses.asdict(LatencyStats.of(churned[0].cpu)),
            "decision_wait_ms": dataclasses.asdict(
                LatencyStats.of(
                    [t - c for t, c in zip(churned[0].total, churned[0].cpu, strict=True)]
                )
            ),
            "blocks_per_s": churned[1],
            "mirror_events_per_s": churned[2],
        },
    }


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    idx, routing = report["index"], report["routing"]
    workers = report["settings"]["workers"]
    table = Table(title=f"Control plane: {workers} workers, {idx['distinct_blocks']:,} blocks")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("indexed blocks (distinct / entries)", f"{idx['distinct_blocks']:,} / {idx['entries']:,}"),
        ("entries = blocks the engines published", str(idx["entries"] == idx["stored_blocks_published"])),
        ("Redis memory per block / per entry", f"{idx['bytes_per_block']:.0f} B / {idx['bytes_per_entry']:.0f} B"),
    ]  # fmt: skip
    for rt in routing:
        d, cpu, lk, h = (
            rt[k] for k in ("decision_ms", "decision_cpu_ms", "lookup_ms", "hashing_ms")
        )
        rows += [
            (f"disaggregate={rt['disaggregate']} ({rt['options']} options), lookup={rt['lookup']}: "
             "decision p50 / p99 / max", f"{d['p50']:.3f} / {d['p99']:.3f} / {d['max']:.3f} ms"),
            ("  router CPU per decision p50 / p99", f"{cpu['p50']:.3f} / {cpu['p99']:.3f} ms"),
            ("  hashing p50 / p99", f"{h['p50']:.3f} / {h['p99']:.3f} ms"),
            ("  lookup p50 / p99 (redis CPU per lookup)",
             f"{lk['p50']:.3f} / {lk['p99']:.3f} ms ({rt['redis_cpu_per_lookup_ms']:.3f} ms)"),
            (f"  p99 <= {rt['p99_target_ms']} ms", str(rt["p99_met"])),
            (f"  decisions/s sequential / {rt['concurrency']} concurrent",
             f"{rt['decisions_per_s']:.0f} / {rt['decisions_per_s_concurrent']:.0f}"),
            (f"  lookups/s, {rt['concurrency']} threads", f"{rt['lookups_per_s_threads']:.0f}"),
            ("  lookups matching the plan", f"{rt['decisions'] - rt['lookup_mismatches']}/{rt['decisions']}"),
            ("  routed to a longest-prefix holder",
             f"{rt['longest_holder_chosen']}/{rt['prompts_with_holder']}"),
        ]  # fmt: skip
        if rt["with_events"]:
            ev = rt["with_events"]
            rows.append((f"  with {ev['blocks_per_s']:,.0f} blocks/s of KV events: decision p50 / p99",
                         f"{ev['decision_ms']['p50']:.3f} / {ev['decision_ms']['p99']:.3f} ms"))  # fmt: skip
            ev_cpu, ev_wait = ev["decision_cpu_ms"], ev["decision_wait_ms"]
            rows.append(("    router CPU p50 / p99; waiting (a core, the GIL) p99",
                         f"{ev_cpu['p50']:.3f} / {ev_cpu['p99']:.3f}; {ev_wait['p99']:.3f} ms"))  # fmt: skip
        if rt["mirror"]:
            rows.append(("  mirror: built in / process memory added",
                         f"{rt['mirror']['build_s']:.1f} s / {rt['mirror']['rss_mb']:.0f} MB"))  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    for role, pub in report.get("publishing", {}).items():
        table.add_row(
            f"publishing, {role} worker ({pub['tokens_per_s']:.0f} tok/s)",
            f"{pub['events_per_s']:.0f} events/s, {pub['blocks_per_s']:.0f} blocks/s, "
            f"{pub['commands_per_s']:.0f} cmds/s, {pub['bytes_in_per_s'] / 1e3:.1f} kB/s",
        )
    mem = report["memory"]
    table.add_row(
        "peak RSS: router process / redis-server / fill process",
        f"{mem['router_process_peak_rss_mb']:.0f} / {mem['redis_peak_rss_mb']:.0f} / "
        f"{mem['fill_process_peak_rss_mb']:.0f} MB",
    )
    Console().print(table)


def _redis_counters(client) -> dict[str, int]:
    info = client.info("memory") | client.info("stats")
    return {k: int(info[k]) for k in ("used_memory", "total_commands_processed",
                                      "total_net_input_bytes")}  # fmt: skip


def _count_blocks(client, prefix: str) -> tuple[int, int]:
    """(block keys, worker entries in them), by SCAN: the index's own content."""
    keys = entries = 0
    batch: list = []
    for key in client.scan_iter(match=prefix + "*", count=10_000):
        batch.append(key)
        if len(batch) == 10_000:
            entries += _sum_hlen(client, batch)
            keys += len(batch)
            batch = []
    return keys + len(batch), entries + _sum_hlen(client, batch)


def _sum_hlen(client, keys: list) -> int:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hlen(key)
    return sum(pipe.execute())


def _rss_mb(pid: int | None, field: str) -> float:
    if pid is None:
        return 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1e3
    return 0.0
