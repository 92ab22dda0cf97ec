"""`pdserve bench peer-pull`: `bench kv-tiers`' multi-turn chat on two decode workers whose
turns land on either worker, served without and with `--peer-pull`: same requests, same run.

    pdserve bench peer-pull [--preset small --system-prompt-len 512] [--policy round_robin]

Two workers that prefill and decode (each pinned to a core), pools large enough that nothing is
evicted, so every prompt token computed past the minimum is one the other worker already had.
The round_robin policy (the default here) sends each turn to either worker regardless of where
the conversation's earlier turns ran: about half the turns land on the worker without their
prefix. Without the pull that worker recomputes it; with the pull it fetches the blocks from
the holder over the KV transport (grpc on loopback) when the router's cost model prices that
under the recompute. Reported each way: prompt tokens computed (the workers' `prefill_tokens`
delta) against the minimum, the tokens pulled, the pulls committed and fallen back, TTFT
p50/p90, and the pull's ratios over the way without, computed from the two rows.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from pathlib import Path

from pdserve.bench.common.local_system import (
    load_model,
    serve_locally,
    start_ray,
    wait_idle,
)
from pdserve.bench.serving import multi_turn_chat

WAYS = ("without", "pull")  # --peer-pull off; on
RATIO_FIELDS = ("computed_tokens", "ttft_p50_ms", "ttft_p90_ms")
# The `WorkerStats` fields measured each way besides the chat's: pulled tokens, pulls
# committed and fallen back.
STAT_FIELDS = ("prefix_peer_hit_tokens", "peer_pulls_committed", "peer_pulls_fallen_back")


def add_arguments(p: argparse.ArgumentParser) -> None:
    multi_turn_chat.add_model_arguments_first(p)
    p.add_argument(
        "--policy",
        default="round_robin",
        help="the router's policy (round_robin: turns land on either worker)",
    )
    p.add_argument("--max-concurrency", type=int, default=1, help="requests in flight")
    multi_turn_chat.add_chat_arguments(p)


@dataclasses.dataclass
class PullResult(multi_turn_chat.ChatResult):
    """The chat served one way."""

    pulled_tokens: int  # of hit_tokens, those pulled from the other worker
    pulls_committed: int
    pulls_fallen_back: int
    ttft_p50_ms: float
    ttft_p90_ms: float


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    model_dir, model_config = load_model(args)
    requests = multi_turn_chat.chat_requests(args, model_config)
    prompts = [r.prompt for r in requests]
    console = Console(width=150)
    console.print(
        f"multi-turn chat on 2 workers ({args.policy}): {len(requests)} requests, "
        f"{sum(len(p) for p in prompts)} prompt tokens, minimum computed "
        f"{multi_turn_chat.minimum_prefill_tokens(prompts, args.block_size)}"
    )
    import ray

    if not ray.is_initialized():  # a test's session cluster, else our own
        start_ray(0, 2)
    results: dict[str, PullResult] = {}
    for way in WAYS:
        console.print(f"[bold]{way}[/bold]: starting")
        started = time.perf_counter()
        with _serve(model_dir, args, requests, peer_pull=way == "pull") as app:
            console.print(f"  started in {time.perf_counter() - started:.1f}s; warming up")
            _warm_up(app, model_config, args)
            results[way] = _measure(app, requests, args)
            console.print(f"  {_line(results[way])}")
    ratios = pull_ratios(results)
    table = _table(results, ratios)
    return multi_turn_chat.report(console, table, results, "pull_over_without", ratios, args.json)


def _serve(model_dir: Path, args: argparse.Namespace, requests: list, peer_pull: bool):
    # Room for every block of the chat on each worker: nothing is evicted, so what one worker
    # recomputes is only what the other one holds.
    tokens = sum(r.prompt_len + r.output_len for r in requests)
    engine = {"block_size": args.block_size, "num_kv_blocks": tokens // args.block_size + 64}
    router = {
        "disaggregate": "never",
        "policy": args.policy,
        "peer_pull": peer_pull,
        "progress_timeout_s": 120.0,  # a long prefill on a loaded machine is not a stall
    }
    return serve_locally(
        model_dir, prefill_workers=0, decode_workers=2, engine=engine, router=router
    )


def _warm_up(app, model_config: dict, args: argparse.Namespace) -> None:
    """Unshared prompts on both workers, so first-call costs stay out of the figures."""
    from pdserve.bench.common.load_generator import run_load

    requests = multi_turn_chat.warm_up_requests(model_config, args)
    records = asyncio.run(run_load(f"127.0.0.1:{app.port}", requests, max_concurrency=1))
    wait_idle(app)
    if not all(r.ok for r in records):
        raise SystemExit(f"warm-up: {sum(not r.ok for r in records)} requests failed")


def _measure(app, requests: list, args: argparse.Namespace) -> PullResult:
    figures, summary, deltas = multi_turn_chat.serve_chat(app, requests, args, STAT_FIELDS)
    pulled, committed, fallen_back = deltas
    return PullResult(
        **figures,
        pulled_tokens=pulled,
        pulls_committed=committed,
        pulls_fallen_back=fallen_back,
        ttft_p50_ms=summary.ttft.p50,
        ttft_p90_ms=summary.ttft.p90,
    )


def pull_ratios(results: dict[str, PullResult]) -> dict[str, float | None]:
    """The pull's figures over the way without's (None where the way without measured 0)."""
    return multi_turn_chat.ratios_over(results["without"], results["pull"], RATIO_FIELDS)


def _line(r: PullResult) -> str:
    return (
        f"computed {r.computed_tokens} tokens ({r.computed_vs_minimum:.2f}x minimum "
        f"{r.minimum_tokens}), hits {r.hit_tokens} (pulled {r.pulled_tokens} in "
        f"{r.pulls_committed} pulls, {r.pulls_fallen_back} fallen back), TTFT p50 "
        f"{r.ttft_p50_ms:.1f} ms p90 {r.ttft_p90_ms:.1f} ms, failed {r.failed}"
    )


def _table(results: dict[str, PullResult], ratios: dict[str, float | None]):
    return multi_turn_chat.chat_table(
        "Peer pull: multi-turn chat on 2 workers (pull vs without)",
        "peer pull",
        {
            "pulled_tokens": "pulled tokens",
            "pulls_committed": "pulls committed",
            "pulls_fallen_back": "fallen back",
        },
        {"ttft_p50_ms": "TTFT p50 ms", "ttft_p90_ms": "TTFT p90 ms"},
        results,
        {"pull/without": ratios},
    )
