"""What the system-level benchmarks share: the model, the workload, a local Ray and a served
system on this machine (loopback KV endpoints, workers pinned to cores, ephemeral ports)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pdserve.models.presets import WEIGHT_PRESETS


def add_model_arguments(parser: argparse.ArgumentParser, preset: str) -> None:
    parser.add_argument("--model", help="model directory (default: the built-in preset below)")
    parser.add_argument("--preset", default=preset, choices=WEIGHT_PRESETS)


def load_model(args: argparse.Namespace) -> tuple[Path, dict]:
    """The model directory (--model, or the built-in --preset, written on first use) and its
    config.json."""
    if args.model:
        model_dir = Path(args.model)
    else:
        from pdserve.models.builtin import builtin_model_dir

        model_dir = builtin_model_dir(args.preset)
    return model_dir, json.loads((model_dir / "config.json").read_text())


def eos_ids(model_config: dict) -> list[int]:
    eos = model_config.get("eos_token_id", [])
    return eos if isinstance(eos, list) else [eos]


def add_mixed_arguments(
    group: Any,
    long_fraction: float,
    long_input: int,
    long_output: int,
    short_input: int,
    short_output: int,
) -> None:
    """The mixed workload's flags (long prompts + short chats), with this benchmark's defaults."""
    group.add_argument("--mixed-long-fraction", type=float, default=long_fraction)
    group.add_argument("--mixed-long-input-len", type=int, default=long_input)
    group.add_argument("--mixed-long-output-len", type=int, default=long_output)
    group.add_argument("--mixed-short-input-len", type=int, default=short_input)
    group.add_argument("--mixed-short-output-len", type=int, default=short_output)


def mixed_requests(args: argparse.Namespace, model_config: dict, num_requests: int, seed: int):
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    dataset = DatasetConfig(
        name="mixed",
        mixed_long_fraction=args.mixed_long_fraction,
        mixed_long_input_len=args.mixed_long_input_len,
        mixed_long_output_len=args.mixed_long_output_len,
        mixed_short_input_len=args.mixed_short_input_len,
        mixed_short_output_len=args.mixed_short_output_len,
    )
    return generate_requests(
        dataset, num_requests, seed, model_config["vocab_size"], eos_ids(model_config)
    )


def start_ray(prefill_workers: int, decode_workers: int) -> None:
    """One local Ray for every system a benchmark starts (the apps leave it running)."""
    import ray

    ray.init(
        include_dashboard=False,
        log_to_driver=False,
        resources={"prefill_pool": max(prefill_workers, 1), "decode_pool": decode_workers},
    )


def serve_locally(
    model_dir: Path,
    *,
    prefill_workers: int,
    decode_workers: int,
    engine: dict | None = None,
    router: dict | None = None,
):
    """A BackgroundApp on this machine, each worker pinned to its own core."""
    from pdserve.app import BackgroundApp
    from pdserve.config import KVTransferConfig, RouterConfig, ServeConfig
    from pdserve.engine_config import EngineConfig

    config = ServeConfig(
        engine=EngineConfig(model=str(model_dir), num_threads=1, **(engine or {})),
        # Every worker is this process's own child on loopback: their KV is trusted, so decode
        # workers reuse pushed prefixes as they would under mutual TLS in a cluster.
        kv=KVTransferConfig(
            bind_host="127.0.0.1", advertise_host="127.0.0.1", trust_peer_cache=True
        ),
        router=RouterConfig(host="127.0.0.1", port=0, http_port=0, **(router or {})),
        prefill_workers=prefill_workers,
        decode_workers=decode_workers,
        pin_cpus=True,
    )
    return BackgroundApp(config)


def add_paired_arguments(
    parser: argparse.ArgumentParser, unit: str, rounds: int, rounds_help: str
) -> None:
    """The flags of a benchmark that serves one random closed-loop workload two ways (one
    `unit` each) and compares them."""
    add_model_arguments(parser, preset="tiny")
    parser.add_argument(
        "--num-requests", type=int, default=64, help=f"requests per {unit} and round"
    )
    parser.add_argument("--max-concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="prompt and output lengths uniform in len x [1 - r, 1 + r] (default: 0, fixed)",
    )
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write both summaries to this file")


def paired_workload(args: argparse.Namespace) -> tuple[Path, list]:
    """The model directory and the random requests of a paired benchmark's flags."""
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    if args.num_requests < 1 or args.max_concurrency < 1 or args.rounds < 1:
        raise SystemExit("--num-requests, --max-concurrency and --rounds must be >= 1")
    model_dir, model_config = load_model(args)
    dataset = DatasetConfig(
        name="random",
        random_input_len=args.input_len,
        random_output_len=args.output_len,
        random_range_ratio=args.random_range_ratio,
    )
    requests = generate_requests(
        dataset, args.num_requests, args.seed, model_config["vocab_size"], eos_ids(model_config)
    )
    return model_dir, requests


def serve_pair(model_dir: Path):
    """The system of a paired benchmark: 1 prefill + 1 decode worker, every prompt prefilled
    remotely."""
    return serve_locally(
        model_dir, prefill_workers=1, decode_workers=1, router={"disaggregate": "always"}
    )


def ratio_table(title: str, names: tuple[str, str], rows: list[tuple[str, float, float]]):
    """A rich table of one metric a row, measured both ways, with the second over the first."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("metric", *names, f"{names[1]}/{names[0]}"):
        table.add_column(column, justify="right")
    for name, a, b in rows:
        table.add_row(name, f"{a:.2f}", f"{b:.2f}", f"{b / a:.3f}" if a else "-")
    return table


def finish_paired(summaries: dict, json_path: str | None) -> int:
    """Writes the summaries to --json if given; the exit status: 0 when no request failed."""
    if json_path:
        Path(json_path).write_text(
            json.dumps({name: s.to_dict() for name, s in summaries.items()}, indent=2)
        )
    return 0 if all(s.failed == 0 for s in summaries.values()) else 1


def wait_idle(app, timeout_s: float = 60.0) -> None:
    """Until no worker has queued or running work (so every prefill is counted)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = ray.get([w.actor.stats.remote() for w in app.app.pool.workers.values()])
        if not any(s.num_waiting or s.num_running or s.num_reserved or s.num_held for s in stats):
            return
        time.sleep(0.2)
