"""`pdserve bench serve`: load a running server and report serving metrics.

    pdserve bench serve --target 127.0.0.1:50051 --dataset mixed --request-rate 8 \\
        --num-requests 500 --slo-ttft-ms 500 --slo-tpot-ms 50 --json out.json --plot plots/
    pdserve bench serve --backend openai --base-url http://127.0.0.1:8000/v1 --vocab-size 32000

The gRPC backend speaks pdserve's API; the openai backend any OpenAI-compatible server
(pdserve's HTTP API or a peer), with the same workloads and the same client-side timing
(pdserve/bench/serving/openai_load.py).

Reports TTFT, TPOT, ITL and E2E (mean, p50, p90, p99), throughputs and SLO goodput; see
pdserve/workloads/metrics.py for the exact definitions. Failed requests are counted by status code.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os

from rich.console import Console

from pdserve.bench.common import report
from pdserve.bench.common.load_generator import run_load
from pdserve.client import DEFAULT_TARGET, GenerationClient, GenerationError
from pdserve.workloads import datasets, metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=os.environ.get("PDSERVE_TARGET", DEFAULT_TARGET), help="host:port"
    )
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    server = parser.add_argument_group("server API")
    server.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="pdserve's gRPC API (--target) or any OpenAI-compatible server (--base-url)",
    )
    server.add_argument("--base-url", help="openai backend: e.g. http://127.0.0.1:8000/v1")
    server.add_argument("--model", help="openai backend: model name (default: the first served)")
    server.add_argument(
        "--vocab-size",
        type=int,
        help="openai backend: token ids of synthetic prompts are below this (default: the "
        "vocabulary the model card says, or the built-in model's)",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=None, help="default: 1000, or all GSP")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of gaps; 1 = Poisson"
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals")
    load.add_argument("--timeout", type=float, default=None, help="per-request deadline (s)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", default="random", help=f"one of: {', '.join(datasets.DATASETS)}")
    data.add_argument(
        "--sharegpt-tokenizer",
        choices=("server", "words"),
        default="server",
        help="count ShareGPT tokens with the server's Tokenize RPC, or approximate by words",
    )
    defaults = datasets.DatasetConfig()
    for f in dataclasses.fields(datasets.DatasetConfig):
        if f.name != "name":
            flag = "--" + f.name.replace("_", "-")
            kind = type(getattr(defaults, f.name))
            data.add_argument(flag, type=kind, default=f.default, help="default: %(default)s")
    out = parser.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    out.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    out.add_argument("--json", metavar="FILE", help="write summary and per-request records")
    out.add_argument("--plot", metavar="DIR", help="write TTFT/TPOT/ITL/E2E CDF PNGs here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    fields = [f.name for f in dataclasses.fields(datasets.DatasetConfig) if f.name != "name"]
    config = datasets.DatasetConfig(name=args.dataset, **{k: getattr(args, k) for k in fields})
    if args.backend == "openai":
        return _run_openai(args, config, err)
    try:
        config.validate()
        _check_load_args(args)
        with GenerationClient(args.target, api_key=args.api_key, timeout=args.timeout) as client:
            info = client.model_info()
            tokenize = None
            if args.dataset.startswith("sharegpt:") and args.sharegpt_tokenizer == "server":
                tokenize = client.tokenize
            num_requests = args.num_requests or datasets.default_num_requests(config)
            requests = datasets.generate_requests(
                config, num_requests, args.seed, info.vocab_size, info.eos_token_ids, tokenize
            )
    except ValueError as error:
        err.print(f"error: {error}", markup=False)
        return 2
    except GenerationError as error:
        err.print(f"error: {error.code.name}: {error.details}", markup=False)
        return 1
    too_long = [r for r in requests if r.prompt_len + r.output_len > info.max_model_len]
    if too_long:
        err.print(
            f"warning: {len(too_long)} requests exceed max_model_len {info.max_model_len} "
            "and will likely fail with INVALID_ARGUMENT",
            markup=False,
        )
    _announce(err, f"{info.name} at {args.target}", len(requests), args)
    records = asyncio.run(run_load(args.target, requests, **_load_options(args)))
    return _report(args, records, info.name, err)


def _report(args: argparse.Namespace, records: list, model: str, err: Console) -> int:
    duration = metrics.run_duration(records)
    slos = (args.slo_ttft_ms, args.slo_tpot_ms)
    summary = metrics.summarize(records, duration, *slos)
    by_tag = metrics.summarize_by_tag(records, duration, *slos)
    by_tag = by_tag if 1 < len(by_tag) <= 4 else {}  # classes (mixed), not 64 GSP groups
    report.print_summary(summary, by_tag)
    if args.json:
        run_config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        run_config["model"] = model
        report.write_json(args.json, summary, records, config=run_config, by_tag=by_tag)
    if args.plot:
        from pdserve.bench.common.plots import plot_cdfs  # matplotlib only when asked for

        slo_ms = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
        plot_cdfs(records, args.plot, {k: v for k, v in slo_ms.items() if v is not None})
    for record in records:
        if not record.ok:  # one example per failure, so the cause is visible without --json
            err.print(f"first failure: {record.error_code}: {record.error}", markup=False)
            break
    return 0 if summary.completed else 1


def _run_openai(args: argparse.Namespace, config: datasets.DatasetConfig, err: Console) -> int:
    """The same run against an OpenAI-compatible server's streaming /v1/completions."""
    import aiohttp

    from pdserve.bench.serving.openai_load import model_card, run_openai_load

    try:
        config.validate()
        _check_load_args(args)
        if not args.base_url:
            raise ValueError("--backend openai needs --base-url (e.g. http://host:8000/v1)")
        card = asyncio.run(model_card(args.base_url, args.api_key, args.model))
        vocab_size = args.vocab_size or card.vocab_size
        if not args.dataset.startswith("sharegpt:") and not vocab_size:
            raise ValueError(
                f"--vocab-size: the server does not say the vocabulary of {card.name}; "
                "give it for token-id prompts"
            )
        num_requests = args.num_requests or datasets.default_num_requests(config)
        requests = datasets.generate_requests(config, num_requests, args.seed, vocab_size or 0)
    except ValueError as error:
        err.print(f"error: {error}", markup=False)
        return 2
    except aiohttp.ClientError as error:
        err.print(f"error: {args.base_url}: {error}", markup=False)
        return 1
    _announce(err, f"{card.name} at {args.base_url} (openai)", len(requests), args)
    records = asyncio.run(
        run_openai_load(args.base_url, card.name, requests, **_load_options(args))
    )
    return _report(args, records, card.name, err)


def _load_options(args: argparse.Namespace) -> dict:
    """The load flags as the keyword arguments of run_load and run_openai_load."""
    return {
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "progress": not args.no_progress,
        "api_key": args.api_key,
        "timeout": args.timeout,
    }


def _announce(err: Console, server: str, num_requests: int, args: argparse.Namespace) -> None:
    """One line on stderr: what is about to be sent, to which server."""
    err.print(
        f"{server}: {num_requests} {args.dataset} requests, "
        f"rate {args.request_rate} req/s, burstiness {args.burstiness}, "
        f"max concurrency {args.max_concurrency or 'unlimited'}, seed {args.seed}",
        markup=False,
    )


def _check_load_args(args: argparse.Namespace) -> None:
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0 (inf sends all at once)")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
