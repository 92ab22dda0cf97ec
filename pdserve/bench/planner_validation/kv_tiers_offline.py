"""`pdserve bench sim-kv-tiers`: `bench kv-tiers`'s comparison (issue 53 point 5) on the planner's
virtual cluster of sim H100s: a multi-turn chat whose working set is 4x one worker's device KV
pool, served without tiers, with a host tier over PCIe 5, with a small host tier over an
NVMe disk tier, and without tiers but with peer pulls (`--peer-pull`: a worker the policy
chooses pulls the prefix another one holds over the deployment's link,
pdserve/planner/virtual_pull.py), each at a sweep of rates on a fresh cluster.

    pdserve bench sim-kv-tiers [--workers 16] [--rates-per-worker 1,2,3,4]

The tiers are the engine's own (pdserve/engine/host_tier.py, disk_tier.py: prefix-closed, least
recently stored first, fixed budgets) with their bytes replaced by transfer time on modelled
links, charged to the step that needs the blocks (pdserve/sim/kv_tiers.py). The workers are
colocated (`disaggregate=never`) behind the `cost` policy, whose index copy (VirtualIndex) is fed
by their KV events, tier moves included, so a conversation's next turn goes back to the worker
that holds its past in any tier.

The device pool is scaled down from an H100's (as `--workload tenants` does), to the chat's
distinct prompt blocks over `--working-set-ratio` x the workers; the tiers are sized in device
pools: the `host` way's host tier holds `--host-pools` of them (an H100 node's ~2 TB of DRAM is
~250 GB a GPU, ~4x what its KV pool gets), the `disk` way's `--disk-host-pools` over a disk
tier of `--disk-pools`.

Reported per way and rate (simulated time): SLO attainment (both `--ttft-slo-ms` and
`--tpot-slo-ms`), TTFT p50/p90, prompt tokens the workers computed against the minimum a cache
that never evicts would reach, blocks brought back from each tier; per way the goodput (DistServe:
the rate at which attainment falls below `--attainment`, `metrics.goodput_rate`); then the tiered
ways' ratios over the way without.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

WAYS = ("without", "host", "disk", "peer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b", help="a shape (pdserve/sim/shapes.py)")
    p.add_argument("--gpu", default="h100", help="the virtual GPU (analytical profile)")
    p.add_argument("--tp", type=int, default=1, help="GPUs per worker (tensor parallel)")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--rates-per-worker", default="1,2,3,4", help="simulated req/s, swept")
    p.add_argument(
        "--ways", default=",".join(WAYS), help="of without,host,disk,peer (without first)"
    )
    p.add_argument("--working-set-ratio", type=float, default=4.0,
                   help="the chat's distinct prompt blocks over the cluster's device KV")  # fmt: skip
    p.add_argument("--host-pools", type=float, default=4.0, help="host way: its host tier")
    p.add_argument("--disk-host-pools", type=float, default=0.5, help="disk way: its host tier")
    p.add_argument("--disk-pools", type=float, default=8.0, help="disk way: its disk tier")
    p.add_argument("--host-link-gbs", type=float, default=50.0, help="per GPU: PCIe 5 x16, H2D")
    p.add_argument("--host-link-latency-us", type=float, default=10.0, help="per block copied")
    p.add_argument("--disk-read-gbs", type=float, default=6.0, help="per GPU: one NVMe drive")
    p.add_argument("--disk-read-latency-us", type=float, default=100.0, help="per block read")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--index-lag-ms", type=float, default=1.0, help="the router's index copy")
    p.add_argument("--peer-link-known", action="store_true",
                   help="peer way: the routers' transfer line starts at the workers' link, not "
                   "its 1 GB/s prior (a colocated cluster learns it only from pulls it makes)")  # fmt: skip
    p.add_argument("--ttft-slo-ms", type=float, default=300.0)
    p.add_argument("--tpot-slo-ms", type=float, default=40.0)
    p.add_argument("--attainment", type=float, default=0.9, help="goodput's SLO attainment")
    chat = p.add_argument_group("multi-turn chat")
    chat.add_argument("--conversations-per-worker", type=int, default=24)
    chat.add_argument("--turns", type=int, default=4)
    chat.add_argument("--system-prompts", type=int, default=8)
    chat.add_argument("--system-prompt-len", type=int, default=512)
    chat.add_argument("--user-len", type=int, default=256)
    chat.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every result and the ratios to this file")


@dataclasses.dataclass
class RatePoint:
    """One way at one rate, in simulated time."""

    way: str
    rate: float  # req/s, the whole cluster
    requests: int
    failed: int
    attainment: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    computed_tokens: int
    minimum_tokens: int
    host_restored_blocks: int
    disk_restored_blocks: int
    peer_hit_tokens: int  # prompt tokens pulled from another worker instead of computed

    @property
    def computed_vs_minimum(self) -> float:
        return self.computed_tokens / max(1, self.minimum_tokens)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.bench.simulation.sim_run import bench_error
    from pdserve.workloads.metrics import goodput_rate

    ways = [w.strip() for w in args.ways.split(",")]
    if set(ways) - set(WAYS) or ways[0] != "without":
        return bench_error(f"--ways: of {','.join(WAYS)}, without first; got {args.ways}", 2)
    console = Console(width=160)
    requests = chat_requests(args)
    pool = pool_blocks(args, requests)
    longest = max(math.ceil((r.prompt_len + r.output_len) / args.block_size) for r in requests)
    if pool < 2 * longest:
        return bench_error(f"a device pool of {pool} blocks is under 2 of the longest request's "
                           f"{longest}: raise --conversations-per-worker", 2)  # fmt: skip
    console.print(
        f"[bold]{args.workers} sim {args.gpu.upper()} workers (TP {args.tp}), {args.model}[/bold]: "
        f"{len(requests)} requests, device pool {pool} blocks each (working set "
        f"{args.working_set_ratio:g}x); per GPU: host link {args.host_link_gbs:g} GB/s + "
        f"{args.host_link_latency_us:g} us a block, disk {args.disk_read_gbs:g} GB/s + "
        f"{args.disk_read_latency_us:g} us a block"
    )
    rates = [float(r) * args.workers for r in args.rates_per_worker.split(",")]
    points: list[RatePoint] = []
    for way in ways:
        deployment = tiered_deployment(args, pool, way)
        for rate in rates:
            point = run_way(deployment, way, rate, requests, args)
            points.append(point)
            console.print(f"  {way} at {rate:g} req/s: {_line(point)}")
    goodput = {
        way: goodput_rate({p.rate: p.attainment for p in points if p.way == way}, args.attainment)
        for way in ways
    }
    console.print(report_table(points))
    lines = ratio_lines(points, goodput, rates)
    for line in lines:
        console.print(line)
    if args.json:
        document = {
            "device_pool_blocks": pool,
            "points": [
                dataclasses.asdict(p) | {"computed_vs_minimum": p.computed_vs_minimum}
                for p in points
            ],  # fmt: skip
            "goodput_req_s": goodput,
            "ratios": lines,
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 1 if any(p.failed for p in points if p.rate == rates[0]) else 0


def chat_requests(args: argparse.Namespace):
    """The chat: every conversation's turn k before any turn k+1, so between two turns of one
    conversation its worker serves the others' turns, about 4x its pool of them."""
    from pdserve.planner.deployment import Deployment
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    model = Deployment(args.model, gpu=args.gpu, tp=args.tp, num_kv_blocks=1)
    config = DatasetConfig(
        name="multi-turn",
        mt_conversations=args.conversations_per_worker * args.workers,
        mt_turns=args.turns,
        mt_system_prompts=args.system_prompts,
        mt_system_prompt_len=args.system_prompt_len,
        mt_user_len=args.user_len,
        mt_output_len=args.output_len,
    )
    count = config.mt_conversations * config.mt_turns
    vocab, special = model.model_config["vocab_size"], model.tokenizer.eos_token_ids
    return generate_requests(config, count, args.seed, vocab, special)


def pool_blocks(args: argparse.Namespace, requests) -> int:
    """Each worker's device pool: the chat's distinct prompt blocks over the working-set ratio
    and the workers (a conversation stays on one worker, so each holds its share)."""
    from pdserve.core.block_hash import prompt_block_hashes

    distinct = {h for r in requests for h in prompt_block_hashes(r.prompt, args.block_size)}
    return math.ceil(len(distinct) / (args.working_set_ratio * args.workers))


def tiered_deployment(args: argparse.Namespace, pool: int, way: str):
    """The deployment of `way`: its device pool, tiers and their links."""
    from pdserve.planner.deployment import Deployment

    plain = Deployment(
        args.model,
        gpu=args.gpu,
        tp=args.tp,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=pool,
    )
    if way in ("without", "peer"):
        return plain
    host_pools, disk_pools = (args.host_pools, 0.0) if way == "host" else (
        args.disk_host_pools, args.disk_pools)  # fmt: skip
    pool_gib = pool * plain.new_engine()[0].bytes_per_block / 2**30
    # The links are per GPU: each rank of a TP worker moves its own heads' slice over its own
    # PCIe link and reads it from its own drive (a DGX H100 has one NVMe drive per GPU).
    sim = dataclasses.replace(
        plain.engine_config.sim,
        host_link_gbs=args.host_link_gbs * args.tp,
        host_link_latency_us=args.host_link_latency_us,
        disk_read_gbs=args.disk_read_gbs * args.tp,
        disk_read_latency_us=args.disk_read_latency_us,
    )
    return plain.with_engine(
        kv_offload_gb=host_pools * pool_gib, kv_disk_gb=disk_pools * pool_gib, sim=sim
    )


def run_way(deployment, way: str, rate: float, requests, args: argparse.Namespace) -> RatePoint:
    from pdserve.bench.common.load_generator import arrival_times
    from pdserve.bench.simulation.sim_routing_bench import minimum_prefill_tokens
    from pdserve.config import RouterConfig
    from pdserve.planner.probe import SLO, Split, run_probe
    from pdserve.planner.workload import ProbeRequest
    from pdserve.workloads.metrics import run_duration, slo_attainment, summarize

    at = arrival_times(len(requests), rate, seed=args.seed)
    probes = [
        ProbeRequest(k, list(r.prompt), r.output_len, t * rate)
        for k, (r, t) in enumerate(zip(requests, at, strict=True))
    ]
    router = RouterConfig(policy="cost", disaggregate="never", ttft_slo_ms=args.ttft_slo_ms,
                          tpot_slo_ms=args.tpot_slo_ms, peer_pull=way == "peer")  # fmt: skip
    slo = SLO(args.ttft_slo_ms, args.tpot_slo_ms, args.attainment)
    _, runs = run_probe(
        deployment, Split(0, args.workers), probes, rate, slo, router, stop_when_certain=False,
        index_lag_s=args.index_lag_ms / 1e3,
        attach=_knowing_the_link if way == "peer" and args.peer_link_known else None,
    )  # fmt: skip
    records = [r.record for r in runs]
    summary = summarize(records, run_duration(records))
    engines = [w.engine.stats() for w in runs[0].cluster.workers.values()]
    return RatePoint(
        way=way,
        rate=rate,
        requests=len(records),
        failed=summary.failed,
        attainment=slo_attainment(records, args.ttft_slo_ms, args.tpot_slo_ms),
        ttft_p50_ms=summary.ttft.p50,
        ttft_p90_ms=summary.ttft.p90,
        computed_tokens=sum(w.stats().prefill_tokens for w in runs[0].cluster.workers.values()),
        minimum_tokens=minimum_prefill_tokens([r.prompt for r in requests], args.block_size),
        host_restored_blocks=sum(int(s["host_restored_blocks"]) for s in engines),
        disk_restored_blocks=sum(int(s["disk_restored_blocks"]) for s in engines),
        peer_hit_tokens=sum(int(s["prefix_peer_hit_tokens"]) for s in engines),
    )


def _knowing_the_link(cluster) -> None:
    """Teaches each router's transfer line the deployment's link, as pushes over it would."""
    sample = 64 << 20
    for routing in cluster.routers:
        for _ in range(8):
            routing.policy.cost.observe_transfer(sample, cluster.deployment.push_seconds(sample))


def _line(p: RatePoint) -> str:
    return (
        f"attainment {p.attainment:.0%}, TTFT p50 {p.ttft_p50_ms:.0f} p90 {p.ttft_p90_ms:.0f} ms, "
        f"computed {p.computed_vs_minimum:.2f}x minimum, blocks back from host "
        f"{p.host_restored_blocks} / disk {p.disk_restored_blocks}, tokens pulled "
        f"{p.peer_hit_tokens}, failed {p.failed}"
    )


def report_table(points: list[RatePoint]):
    from rich.table import Table

    table = Table(title="Multi-turn chat, working set 4x the device KV (simulated time)")
    for column in ("way", "req/s", "attainment", "TTFT p50 ms", "TTFT p90 ms",
                   "computed / minimum", "host blocks back", "disk blocks back", "tokens pulled",
                   "failed"):  # fmt: skip
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(
            p.way, f"{p.rate:g}", f"{p.attainment:.0%}", f"{p.ttft_p50_ms:.0f}",
            f"{p.ttft_p90_ms:.0f}", f"{p.computed_vs_minimum:.2f}x", str(p.host_restored_blocks),
            str(p.disk_restored_blocks), str(p.peer_hit_tokens), str(p.failed),
        )  # fmt: skip
    return table


def ratio_lines(
    points: list[RatePoint], goodput: dict[str, float], rates: list[float]
) -> list[str]:
    """Each tiered way over the way without: goodput, and at the lowest rate (no queueing: the
    tier's own effect) TTFT p50/p90 and prompt tokens computed."""
    of = {(p.way, p.rate): p for p in points}
    base = of.get(("without", rates[0]))
    lines = []
    for way in (w for w in goodput if w != "without"):
        p = of[way, rates[0]]
        gain = goodput[way] / goodput["without"] if goodput["without"] else float("inf")
        lines.append(
            f"{way} vs without: goodput {goodput[way]:.1f} vs {goodput['without']:.1f} req/s = "
            f"{gain:.2f}x; at {rates[0]:g} req/s TTFT p50 {p.ttft_p50_ms / base.ttft_p50_ms:.2f}x "
            f"p90 {p.ttft_p90_ms / base.ttft_p90_ms:.2f}x, prefill computed "
            f"{p.computed_vs_minimum:.2f}x minimum (without: {base.computed_vs_minimum:.2f}x)"
        )
    return lines
