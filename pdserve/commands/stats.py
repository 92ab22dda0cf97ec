"""`pdserve stats`: prefix-cache reuse (hit and miss prompt tokens) per worker and model, and
speculative decoding's acceptance (draft tokens accepted, accepted tokens per verify step),
and the online planner's latest split (`pdserve serve --plan-interval`).

The numbers live in the prefix-index Redis; the router adds to them as it routes and as it
polls the workers. Without --redis-url it reads $PDSERVE_REDIS_URL, else the private server a
local `pdserve serve` noted in ~/.cache/pdserve/redis-urls/ (the one whose router is --target,
or the only one running), else redis://127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="the prefix-index Redis (redis://, rediss://)")
    parser.add_argument("--model", help="only this model (default: every model with statistics)")
    parser.add_argument(
        "--target",
        type=router_port,
        metavar="HOST:PORT",
        help="the router of the local `pdserve serve` whose private Redis to read, as "
        "`pdserve generate --target` (needed only when several run)",
    )
    # Before --target: the router port alone. Kept so that old scripts run; not in --help.
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--namespace", default="pdserve", help="key prefix (default: pdserve)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def router_port(target: str) -> int:
    """The port of a `HOST:PORT` (or a bare port) --target."""
    try:
        port = int(target.rsplit(":", 1)[-1])
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"HOST:PORT with a port in [1, 65535], got {target!r}")
    return port


def resolve_url(given: str | None, router_port: int | None = None) -> str:
    """The Redis to read; raises LookupError when the local servers leave it ambiguous."""
    if given:
        return given
    if os.environ.get("PDSERVE_REDIS_URL"):
        return os.environ["PDSERVE_REDIS_URL"]
    from pdserve.prefix_index.local_servers import find_local_url

    return find_local_url(router_port) or DEFAULT_URL


def redact(url: str) -> str:
    """The URL without its password, for error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def run(args: argparse.Namespace) -> int:
    import redis

    from pdserve.prefix_index.redis_link import connect
    from pdserve.prefix_index.reuse_stats import read_reuse_stats
    from pdserve.prefix_index.spec_stats import read_speculation_stats

    if args.port is not None:
        print("warning: --port is deprecated; use --target HOST:PORT", file=sys.stderr)
    port = args.target if args.target is not None else args.port
    try:
        url = resolve_url(args.redis_url, port)
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    found_no_server = url == DEFAULT_URL and not (
        args.redis_url or os.environ.get("PDSERVE_REDIS_URL")
    )
    try:
        client = connect(url, socket_timeout_s=2.0)
        stats = read_reuse_stats(client, args.namespace, args.model)
        speculation = read_speculation_stats(client, list(stats), args.namespace)
        plans = _read_plans(client, list(stats), args.namespace)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        if found_no_server:
            message = (
                "no pdserve server found on this machine: is `pdserve serve` running? "
                "(--target, or --redis-url for a remote one)"
            )
        else:
            message = f"cannot reach Redis at {redact(url)} (--redis-url): {exc}"
        print(f"error: {message}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a malformed URL or model name
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        report = {m: s.as_dict() for m, s in stats.items()}
        for model, spec in speculation.items():
            report[model]["speculation"] = spec.as_dict()
        for model, plan in plans.items():
            report[model]["plan"] = plan
        print(json.dumps(report, indent=2))
        return 0
    if not stats:
        print(f"no reuse statistics yet in {redact(url)}")
        return 0
    _print_tables(stats, speculation, plans)
    return 0


def _read_plans(client, models: list[str], namespace: str) -> dict[str, dict]:
    """The online planner's latest plan of each model that has one (`--plan-interval`)."""
    from pdserve.prefix_index.schema import IndexKeys

    plans = {}
    for model in models:
        text = client.get(IndexKeys(model, namespace).plan)
        if text:
            plans[model] = json.loads(text)
    return plans


def plan_line(plan: dict) -> str:
    """One line of `pdserve stats` for an online plan (pdserve/planner/online.py's answer)."""
    if "error" in plan:
        return f"online plan: none ({plan['error']})"
    age = time.time() - plan["planned_at"] if "planned_at" in plan else None
    when = "" if age is None else f", {age:.0f} s ago"
    needed = plan.get("workers_for_observed")
    return (
        f"online plan: {plan['recommended']} for {plan['workers']} workers; goodput "
        f"{plan['goodput_rps']:.2f} req/s vs observed {plan['observed_rps']:.2f} req/s"
        f"{'' if needed is None else f' (~{needed} workers for the observed rate)'}{when}"
    )


# (column, cell of one row's counts) of each table.
REUSE_COLUMNS = (
    ("requests", lambda c: f"{c.requests:,}"),
    ("hit tokens", lambda c: f"{c.hit_tokens:,}"),
    ("miss tokens", lambda c: f"{c.miss_tokens:,}"),
    ("hit rate", lambda c: f"{c.hit_rate:.1%}"),
)
SPECULATION_COLUMNS = (
    ("draft tokens", lambda c: f"{c.draft_tokens:,}"),
    ("accepted", lambda c: f"{c.accepted_tokens:,}"),
    ("acceptance", lambda c: f"{c.acceptance_rate:.1%}"),
    ("accepted per step", lambda c: f"{c.mean_accepted:.2f}"),
)


def _print_tables(stats, speculation, plans) -> None:
    from rich.console import Console

    console = Console()
    for model, reuse in stats.items():
        console.print(_table(f"prefix reuse: {model}", REUSE_COLUMNS, reuse))
        if model in speculation:
            title = f"speculative decoding: {model}"
            console.print(_table(title, SPECULATION_COLUMNS, speculation[model]))
        if model in plans:
            console.print(plan_line(plans[model]))


def _table(title: str, columns, counts):
    """One row per worker, then the model's total (`counts.workers`, `counts.total`)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("worker", justify="left")
    for column, _ in columns:
        table.add_column(column, justify="right")
    for name, worker_counts in sorted(counts.workers.items()):
        table.add_row(name, *(cell(worker_counts) for _, cell in columns))
    table.add_section()
    table.add_row("all workers", *(cell(counts.total) for _, cell in columns))
    return table
