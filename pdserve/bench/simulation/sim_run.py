"""A workload on a served system of simulated workers, reported in simulated time (issue 14).

`serve_sim(model_dir, cluster)` starts the real router, Ray actors and Redis index with both
pools `engine="sim"`; every modelled duration lasts `time_scale` times as long in wall time, so
the router's SLO targets and timeouts are stretched by the same factor. `run_sim_load` offers
the workload at its simulated rate (wall rate = rate / scale) and returns records whose times
are simulated seconds (wall / scale). Whether a run's figures count: `sim_saturation.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.workloads.datasets import BenchRequest
from pdserve.workloads.metrics import RequestRecord

DEFAULT_PRESET = "llama-3.1-8b"


@dataclass
class SimCluster:
    """A served system of sim workers; latency targets are in simulated milliseconds."""

    prefill_workers: int
    decode_workers: int
    profile: str = "analytical:h100"
    time_scale: float = 10.0
    dtype: str = "bfloat16"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: what the profile's GPU holds after the weights
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy: str = "cost"
    disaggregate: str = "auto"
    ttft_slo_ms: float = 400.0
    tpot_slo_ms: float = 40.0
    # Payload of one KV chunk (None: the transport's default). A sim chunk carries no bytes and
    # sleeps its share of the modelled link time, so the split changes nothing modelled; each
    # chunk only adds this machine's thread and gRPC hops to the push, counted in simulated
    # time at 1 / time_scale of their wall time.
    kv_chunk_bytes: int | None = None
    hybrid: bool = False  # the decode workers also prefill for one another (`--hybrid`)


def add_cluster_arguments(
    parser: argparse.ArgumentParser, time_scale: float, step_tokens: int = 8192
) -> None:
    """Flags every sim benchmark shares: the model shape, profile, time scale and KV pool.
    The step token budget defaults to vLLM's for its API server on 80 GB-class GPUs (8192,
    `vllm/engine/arg_utils.py`)."""
    parser.add_argument(
        "--model",
        help="config-only model directory (default: the llama-3.1-8b shape, written on first use)",
    )
    parser.add_argument("--sim-profile", default="analytical:h100")
    parser.add_argument(
        "--sim-time-scale",
        type=float,
        default=time_scale,
        help="wall seconds per simulated second; raise it when the run is refused as saturated",
    )
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        help="KV pool per worker (default: the profile GPU's memory after the weights)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=step_tokens, help="token budget of one step"
    )
    parser.add_argument(
        "--max-excess",
        type=float,
        default=0.05,
        help="refuse when a worker's measured step time exceeds the modelled by more than this",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="run a refused (saturated) measurement again this many times before giving up",
    )
    parser.add_argument(
        "--max-overrun-fraction",
        type=float,
        default=0.01,
        help="refuse when more of a worker's decode steps than this overran the scaled model",
    )


def ensure_ray(prefill_workers: int, decode_workers: int) -> None:
    """A local Ray with both pools, unless this process already runs one (tests)."""
    import ray

    if not ray.is_initialized():
        from pdserve.bench.common.local_system import start_ray

        start_ray(prefill_workers, decode_workers)


def cluster_from_args(args: argparse.Namespace, **fields) -> SimCluster:
    return SimCluster(
        profile=args.sim_profile,
        time_scale=args.sim_time_scale,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **fields,
    )


def config_only_model(preset: str = DEFAULT_PRESET, directory: Path | None = None) -> Path:
    """A config-only model directory of `preset` under the cache directory, written on first use
    as `pdserve make-model --config-only` writes it (the shape's config.json and pdserve's
    tokenizer at its vocabulary size)."""
    import json

    from pdserve.config import default_cache_dir
    from pdserve.models.tokenizer_builder import write_tokenizer
    from pdserve.sim.shapes import shape_config

    directory = directory or default_cache_dir() / "sim-models" / preset
    if not (directory / "tokenizer.json").exists():
        config = shape_config(preset)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        write_tokenizer(directory, config["vocab_size"])
    return directory


def bench_error(line: str, exit_code: int) -> int:
    """Prints a bench's one-line error as the CLI prints a CommandError and returns the exit
    status (pdserve.commands is not imported here: it leads to the planner, which imports the
    benchmarks)."""
    print(f"pdserve bench: error: {line}", file=sys.stderr, flush=True)
    return exit_code


def gpu_kv_blocks(model_config: dict, cluster: SimCluster) -> int:
    """KV blocks of one worker: the profile GPU's memory (x tensor parallel degree) less one
    copy of the weights, in blocks of `cluster.block_size` tokens."""
    from pdserve.sim import model_shape
    from pdserve.sim.profiles import AnalyticalProfile, parse_profile

    profile = parse_profile(cluster.profile)
    if not isinstance(profile, AnalyticalProfile):
        raise ValueError(f"{cluster.profile}: no GPU to size the KV pool by; give --num-kv-blocks")
    return max(
        1,
        model_shape.gpu_kv_blocks(
            model_config, profile.gpu, profile.tp, cluster.dtype, cluster.block_size
        ),
    )


def serve_sim(model_dir: Path, cluster: SimCluster, model_config: dict | None = None):
    """A BackgroundApp of sim workers (not pinned: many share the cores). Ray must already run
    with enough `prefill_pool` and `decode_pool` (local_system.start_ray)."""
    import json

    from pdserve.app import BackgroundApp
    from pdserve.config import KVTransferConfig, RouterConfig, ServeConfig
    from pdserve.engine_config import EngineConfig, SimConfig

    config_json = model_config or json.loads((Path(model_dir) / "config.json").read_text())
    blocks = cluster.num_kv_blocks or gpu_kv_blocks(config_json, cluster)
    scale = cluster.time_scale
    engine = EngineConfig(
        model=str(model_dir),
        kind="sim",
        dtype=cluster.dtype,
        block_size=cluster.block_size,
        num_kv_blocks=blocks,
        max_num_seqs=cluster.max_num_seqs,
        max_num_batched_tokens=cluster.max_num_batched_tokens,
        sim=SimConfig(profile=cluster.profile, time_scale=scale),
    )
    config = ServeConfig(
        engine=engine,
        kv=KVTransferConfig(
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            trust_peer_cache=True,
            reservation_timeout_s=30.0 * scale,
            **({"chunk_bytes": cluster.kv_chunk_bytes} if cluster.kv_chunk_bytes else {}),
        ),
        # The router sees wall time: its targets and patience stretch with the model.
        router=RouterConfig(
            host="127.0.0.1",
            port=0,
            http_port=0,
            policy=cluster.policy,
            disaggregate=cluster.disaggregate,
            ttft_slo_ms=cluster.ttft_slo_ms * scale,
            tpot_slo_ms=cluster.tpot_slo_ms * scale,
            max_pending_requests=4096,
            progress_timeout_s=5.0 * max(1.0, scale),
            hybrid=cluster.hybrid,
        ),
        prefill_workers=cluster.prefill_workers,
        decode_workers=cluster.decode_workers,
        prefill_engine="sim",
        decode_engine="sim",
    )
    return BackgroundApp(config)


def set_routing(
    app, policy: str | None = None, disaggregate: str | None = None, forget_costs: bool = False
) -> None:
    """Swaps the served router's policy (and disaggregate mode) in place, keeping its learned
    costs (several policies measured on one started system) unless `forget_costs`: then the
    cost model starts again from its priors, with every worker's counters as they are now for
    its baseline, as a started router gets them from its first poll (without them the first
    poll after the swap only sets the baseline, and the steps before it, a run's first
    prefills, are never learned from). Call it between runs, when idle."""
    from router.cost_model import CostModel
    from router.policy import RoutingPolicy

    routing = app.app.routing
    old = routing.policy
    config = replace(
        old.config,
        policy=policy or old.config.policy,
        disaggregate=disaggregate or old.config.disaggregate,
    )
    cost = old.cost
    if forget_costs:
        cost = CostModel(step_tokens=old.cost.step_tokens)
        for worker in routing.pool.workers.values():
            if worker.stats is not None:
                cost.observe_stats(worker.stats)
    routing.policy = RoutingPolicy(config, cost=cost, weights=old.weights)


def run_sim_load(
    app,
    requests: Sequence[BenchRequest],
    rate: float,
    time_scale: float,
    seed: int = 0,
) -> list[RequestRecord]:
    """Offers `requests` at `rate` simulated requests/s; the records' times are simulated
    seconds (wall / time_scale), so every latency and duration derived from them is too."""
    from pdserve.bench.common.load_generator import run_load

    wall_rate = rate / time_scale if math.isfinite(rate) else rate
    records = asyncio.run(
        run_load(f"127.0.0.1:{app.port}", requests, request_rate=wall_rate, seed=seed)
    )
    return [to_sim_time(r, time_scale) for r in records]


def local_prefill_fraction(records: Sequence[RequestRecord]) -> float:
    """The fraction of completed requests whose prompt their decode worker computed (the
    server's timings name the same worker for both)."""
    done = [r for r in records if r.ok]
    local = sum(
        bool(r.server_timings.get("prefill_worker"))
        and r.server_timings.get("prefill_worker") == r.server_timings.get("decode_worker")
        for r in done
    )
    return local / max(1, len(done))


def to_sim_time(record: RequestRecord, time_scale: float) -> RequestRecord:
    return replace(
        record,
        send_time=record.send_time / time_scale,
        chunk_times=[t / time_scale for t in record.chunk_times],
        end_time=None if record.end_time is None else record.end_time / time_scale,
    )


def sim_workers(app) -> dict:
    """worker id -> WorkerStats of every worker of the app."""
    import ray

    workers = list(app.app.pool.workers.values())
    stats = ray.get([w.actor.stats.remote() for w in workers])
    return {w.worker_id: s for w, s in zip(workers, stats, strict=True)}


def wait_idle(app, timeout_s: float = 120.0) -> None:
    """Until no worker has queued, running, reserved or held work."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = sim_workers(app).values()
        if not any(s.num_waiting or s.num_running or s.num_reserved or s.num_held for s in stats):
            return
        time.sleep(0.2)
