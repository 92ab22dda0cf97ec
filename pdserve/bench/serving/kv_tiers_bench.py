"""`pdserve bench kv-tiers`: a multi-turn chat whose working set outgrows the device KV pool,
served without tiers, with the host tier (--kv-offload-gb), and with a small host tier over a
disk tier (--kv-disk-dir, --kv-disk-gb): same requests, same run.

    pdserve bench kv-tiers [--ways without,host,disk] [--preset small --system-prompt-len 1024]

One worker that prefills and decodes (pinned to a core) holds a KV pool sized to 1/4 of the
chat's distinct prompt blocks (--working-set-ratio), so each conversation's earlier turns are
evicted before its next turn comes. Without a tier they are recomputed; with the host tier they
are copied back from host memory; in the disk way the host tier holds a quarter of the device
pool (--disk-host-ratio), so most of them are read back from files. Reported each way: prompt
tokens the worker computed (the `WorkerStats.prefill_tokens` delta, = prompt tokens - prefix
hit tokens) against the minimum a cache that never evicts would reach
(`multi_turn_chat.minimum_prefill_tokens`), the prefix hit tokens (and those from the host and
the disk tier), TTFT p50/p99, and each tiered way's ratios over the way without.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.bench.common.local_system import (
    load_model,
    serve_locally,
    start_ray,
    wait_idle,
)
from pdserve.bench.serving import multi_turn_chat

WAYS = ("without", "host", "disk")  # no tier; the host tier; a small host tier over a disk tier
RATIO_FIELDS = ("computed_tokens", "ttft_p50_ms", "ttft_p99_ms")
# The `WorkerStats` fields measured each way besides the chat's: prefix hit tokens from the
# host and from the disk tier.
STAT_FIELDS = ("prefix_host_hit_tokens", "prefix_disk_hit_tokens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    multi_turn_chat.add_model_arguments_first(p)
    p.add_argument(
        "--working-set-ratio",
        type=float,
        default=4.0,
        help="the chat's distinct prompt blocks over the device KV pool's blocks",
    )
    p.add_argument(
        "--kv-offload-gb",
        type=float,
        default=0.05,
        help="the host tier of the 'host' way (GiB; enough for the whole working set)",
    )
    p.add_argument(
        "--kv-disk-gb",
        type=float,
        default=0.5,
        help="the disk tier of the 'disk' way (GiB, in a temporary directory; enough for the "
        "whole working set)",
    )
    p.add_argument(
        "--disk-host-ratio",
        type=float,
        default=0.25,
        help="the host tier of the 'disk' way, in device pools (most evictions reach the disk)",
    )
    p.add_argument(
        "--ways",
        default=",".join(WAYS),
        help=f"which systems to serve, comma-separated, of {','.join(WAYS)} (without first)",
    )
    p.add_argument("--max-concurrency", type=int, default=2, help="requests in flight")
    multi_turn_chat.add_chat_arguments(p)


@dataclasses.dataclass
class TierResult(multi_turn_chat.ChatResult):
    """The chat served one way."""

    host_hit_tokens: int  # of hit_tokens, those copied back from the host tier
    disk_hit_tokens: int  # of hit_tokens, those read back from the disk tier
    ttft_p50_ms: float
    ttft_p99_ms: float
    # TTFT p50 of prompts wholly in the device cache (one token computed): what a request costs
    # besides its prefill (router, gRPC, scheduling, a step, streaming), the floor that no tier
    # can lower.
    ttft_floor_ms: float


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    ways = _ways(args.ways)
    model_dir, model_config = load_model(args)
    requests = multi_turn_chat.chat_requests(args, model_config)
    prompts = [r.prompt for r in requests]
    distinct_blocks = _distinct_blocks(prompts, args.block_size)
    num_kv_blocks = _pool_blocks(args, requests, distinct_blocks)
    console = Console(width=150)
    console.print(
        f"multi-turn chat: {len(requests)} requests, "
        f"{sum(r.prompt_len for r in requests)} prompt tokens, {distinct_blocks} distinct "
        f"blocks over a pool of {num_kv_blocks} ({distinct_blocks / num_kv_blocks:.1f}x), "
        f"minimum computed {multi_turn_chat.minimum_prefill_tokens(prompts, args.block_size)}"
    )
    import ray

    if not ray.is_initialized():  # a test's session cluster, else our own
        start_ray(0, 1)
    results: dict[str, TierResult] = {}
    for way in ways:
        with tempfile.TemporaryDirectory(prefix="pdserve-kv-disk-") as disk_dir:
            tiers = _tiers(way, args, model_config, num_kv_blocks, disk_dir)
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in tiers.items())
            console.print(f"[bold]{way}[/bold] ({flags or 'no tier'}): starting")
            started = time.perf_counter()
            with _serve(model_dir, args, num_kv_blocks, tiers) as app:
                console.print(f"  started in {time.perf_counter() - started:.1f}s; warming up")
                floor_ms = _warm_up(app, model_config, args)
                results[way] = _measure(app, requests, args, floor_ms)
                console.print(f"  {_line(results[way])}")
    ratios = _ratios(results)
    table = _table(results, ratios)
    return multi_turn_chat.report(console, table, results, "over_without", ratios, args.json)


def _ways(text: str) -> list[str]:
    ways = [w.strip() for w in text.split(",") if w.strip()]
    if not ways or ways[0] != "without" or not set(ways) <= set(WAYS) or len(set(ways)) < len(ways):
        raise SystemExit(f"--ways: 'without' first, then any of {WAYS[1:]}, got {text!r}")
    return ways


def _tiers(
    way: str, args: argparse.Namespace, model_config: dict, num_kv_blocks: int, disk_dir: str
) -> dict:
    """The engine's tier settings of one way."""
    from pdserve.core.model_limits import kv_bytes_per_block

    if way == "without":
        return {}
    if way == "host":
        return {"kv_offload_gb": args.kv_offload_gb}
    pool_gb = num_kv_blocks * kv_bytes_per_block(model_config, args.block_size, "float32") / 2**30
    return {
        "kv_offload_gb": round(pool_gb * args.disk_host_ratio, 6),
        "kv_disk_dir": disk_dir,
        "kv_disk_gb": args.kv_disk_gb,
    }


def _distinct_blocks(prompts: list[list[int]], block_size: int) -> int:
    from pdserve.core.block_hash import prompt_block_hashes

    return len({h for prompt in prompts for h in prompt_block_hashes(prompt, block_size)})


def _pool_blocks(args: argparse.Namespace, requests: list, distinct_blocks: int) -> int:
    """The device pool: the working set over --working-set-ratio, refused when it cannot hold
    the requests in flight (the ratio would then measure preemption, not the tier)."""
    if args.working_set_ratio < 1 or args.max_concurrency < 1:
        raise SystemExit("--working-set-ratio must be >= 1 and --max-concurrency >= 1")
    longest = max(r.prompt_len + r.output_len for r in requests)
    in_flight = args.max_concurrency * math.ceil(longest / args.block_size)
    pool = math.ceil(distinct_blocks / args.working_set_ratio)
    if pool < in_flight:
        raise SystemExit(
            f"--working-set-ratio {args.working_set_ratio:g} leaves {pool} blocks, fewer than "
            f"the {in_flight} that --max-concurrency {args.max_concurrency} sequences need: "
            "lengthen the chat (--conversations) or lower the ratio"
        )
    return pool


def _serve(model_dir: Path, args: argparse.Namespace, num_kv_blocks: int, tiers: dict):
    engine = {"block_size": args.block_size, "num_kv_blocks": num_kv_blocks, **tiers}
    return serve_locally(
        model_dir,
        prefill_workers=0,
        decode_workers=1,
        engine=engine,
        # One worker, nothing to fail over to: a long prefill step of a larger preset on a
        # loaded machine is not a stall (the router's default gives up after 5 s silent).
        router={"disaggregate": "never", "progress_timeout_s": 120.0},
    )


def _warm_up(app, model_config: dict, args: argparse.Namespace) -> float:
    """Unshared prompts first, so first-call costs stay out of the figures; then each again
    right after itself, wholly in the device cache (one fits the pool; all of them may not):
    the repeats' TTFT p50 is returned (`TierResult.ttft_floor_ms`)."""
    from pdserve.bench.common.load_generator import run_load

    requests = multi_turn_chat.warm_up_requests(model_config, args)
    target = f"127.0.0.1:{app.port}"
    asyncio.run(run_load(target, requests, max_concurrency=1))
    again = []
    for request in requests:
        asyncio.run(run_load(target, [request], max_concurrency=1))
        again += asyncio.run(run_load(target, [request], max_concurrency=1))
    wait_idle(app)
    ttfts = [r.ttft * 1000 for r in again if r.ok and r.ttft is not None]
    if len(ttfts) < len(again):
        raise SystemExit(f"warm-up: {len(again) - len(ttfts)} of {len(again)} requests failed")
    return statistics.median(ttfts)


def _measure(app, requests: list, args: argparse.Namespace, floor_ms: float) -> TierResult:
    figures, summary, deltas = multi_turn_chat.serve_chat(app, requests, args, STAT_FIELDS)
    host_hits, disk_hits = deltas
    return TierResult(
        **figures,
        host_hit_tokens=host_hits,
        disk_hit_tokens=disk_hits,
        ttft_p50_ms=summary.ttft.p50,
        ttft_p99_ms=summary.ttft.p99,
        ttft_floor_ms=floor_ms,
    )


def _ratios(results: dict[str, TierResult]) -> dict[str, dict[str, float | None]]:
    """Each tiered way's figures over the way without's."""
    without = results["without"]
    return {
        way: multi_turn_chat.ratios_over(without, r, RATIO_FIELDS)
        for way, r in results.items()
        if way != "without"
    }


def _line(r: TierResult) -> str:
    return (
        f"computed {r.computed_tokens} tokens ({r.computed_vs_minimum:.2f}x minimum "
        f"{r.minimum_tokens}), hits {r.hit_tokens} (host {r.host_hit_tokens}, disk "
        f"{r.disk_hit_tokens}), TTFT p50 "
        f"{r.ttft_p50_ms:.1f} ms p99 {r.ttft_p99_ms:.1f} ms (cached prompt "
        f"{r.ttft_floor_ms:.1f} ms), failed {r.failed}"
    )


def _table(results: dict[str, TierResult], ratios: dict[str, dict[str, float | None]]):
    return multi_turn_chat.chat_table(
        "KV tiers: multi-turn chat, working set > device pool (vs without)",
        "tiers",
        {"host_hit_tokens": "host hit tokens", "disk_hit_tokens": "disk hit tokens"},
        {"ttft_p50_ms": "TTFT p50 ms", "ttft_p99_ms": "TTFT p99 ms"},
        results,
        {f"{way}/without": ratio for way, ratio in ratios.items()},
    )
