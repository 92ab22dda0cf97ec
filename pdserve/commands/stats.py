"""`pdserve stats`: prefix-cache reuse (hit and miss prompt tokens) per worker and model.

The numbers live in the prefix-index Redis; the router adds to them as it routes. Without
--redis-url it reads $PDSERVE_REDIS_URL, else the private server a local `pdserve serve` noted
in ~/.cache/pdserve/redis-urls/ (the one on router port --port, or the only one running), else
redis://127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="the prefix-index Redis (redis://, rediss://)")
    parser.add_argument("--model", help="only this model (default: every model with statistics)")
    parser.add_argument(
        "--port",
        type=int,
        help="read the private Redis of the local `pdserve serve` on this router port "
        "(needed only when several run)",
    )
    parser.add_argument("--namespace", default="pdserve", help="key prefix (default: pdserve)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


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

    try:
        url = resolve_url(args.redis_url, args.port)
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        stats = read_reuse_stats(connect(url, socket_timeout_s=2.0), args.namespace, args.model)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        print(f"error: cannot reach Redis at {redact(url)}: {exc}", file=sys.stderr)
        print("hint: pass the server's address with --redis-url", file=sys.stderr)
        return 1
    except ValueError as exc:  # a malformed URL or model name
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({m: s.as_dict() for m, s in stats.items()}, indent=2))
        return 0
    if not stats:
        print(f"no reuse statistics yet in {redact(url)}")
        return 0
    _print_tables(stats)
    return 0


def _print_tables(stats) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for model, reuse in stats.items():
        table = Table(title=f"prefix reuse: {model}", title_justify="left")
        for column in ("worker", "requests", "hit tokens", "miss tokens", "hit rate"):
            table.add_column(column, justify="left" if column == "worker" else "right")
        for name, counts in sorted(reuse.workers.items()):
            table.add_row(name, *_cells(counts))
        table.add_section()
        table.add_row("all workers", *_cells(reuse.total))
        console.print(table)


def _cells(counts) -> list[str]:
    return [
        f"{counts.requests:,}",
        f"{counts.hit_tokens:,}",
        f"{counts.miss_tokens:,}",
        f"{counts.hit_rate:.1%}",
    ]
