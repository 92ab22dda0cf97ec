"""Human and machine reports of a serving benchmark: a rich table and a JSON file."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pdserve.workloads.metrics import BenchSummary, LatencyStats, RequestRecord

_LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))


def summary_table(summary: BenchSummary, title: str = "Serving benchmark") -> Table:
    """Counts, throughputs and goodput, then one row per latency (ms)."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    for name in ("value", "mean", "p50", "p90", "p99", "max"):
        table.add_column(name, justify="right")
    rows: list[tuple[str, str]] = [
        ("requests completed", f"{summary.completed} / {summary.num_requests}"),
        ("requests failed", f"[red]{summary.failed}[/]" if summary.failed else "0"),
        *((f"  {code}", str(count)) for code, count in summary.failures.items()),
        ("duration (s)", f"{summary.duration_s:.2f}"),
        ("input tokens", str(summary.total_input_tokens)),
        ("  of which cached", str(summary.cached_prompt_tokens)),
        ("output tokens", str(summary.total_output_tokens)),
        ("request throughput (req/s)", f"{summary.request_throughput:.2f}"),
        ("output throughput (tok/s)", f"{summary.output_throughput:.1f}"),
        ("total throughput (tok/s)", f"{summary.total_token_throughput:.1f}"),
    ]
    if summary.goodput is not None:
        slos = [
            f"{name} <= {value:g} ms"
            for name, value in (("TTFT", summary.slo_ttft_ms), ("TPOT", summary.slo_tpot_ms))
            if value is not None
        ]
        table.caption = f"SLOs: {', '.join(slos)}"
        rows.append(("goodput (req/s)", f"{summary.goodput:.2f}"))
        rows.append(("  requests meeting SLOs", f"{summary.good_requests} / {summary.completed}"))
    for label, value in rows:
        table.add_row(label, value)
    table.add_section()
    for label, attribute in _LATENCIES:
        stats: LatencyStats = getattr(summary, attribute)
        if stats.count == 0:
            table.add_row(f"{label} (ms)", "no samples", "-", "-", "-", "-", "-")
            continue
        values = (stats.mean, stats.p50, stats.p90, stats.p99, stats.max)
        table.add_row(f"{label} (ms)", f"n={stats.count}", *(f"{v:.2f}" for v in values))
    return table


def tag_table(by_tag: Mapping[str, BenchSummary]) -> Table:
    """One row per request class: counts, TTFT and TPOT percentiles (ms), goodput."""
    table = Table(title="By request class", show_header=True, header_style="bold")
    columns = ("class", "completed", "failed", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")
    for name in (*columns, "goodput"):
        table.add_column(name, justify="left" if name == "class" else "right")
    for tag, s in by_tag.items():
        latencies = (s.ttft.p50, s.ttft.p99, s.tpot.p50, s.tpot.p99)
        goodput = "-" if s.goodput is None else f"{s.goodput:.2f}"
        counts = (str(s.completed), str(s.failed))
        table.add_row(tag or "(none)", *counts, *(f"{v:.2f}" for v in latencies), goodput)
    return table


def print_summary(
    summary: BenchSummary,
    by_tag: Mapping[str, BenchSummary] | None = None,
    console: Console | None = None,
) -> None:
    """Prints the summary table, then a per-class table when there are several classes."""
    console = console or Console()
    console.print(summary_table(summary))
    if by_tag and len(by_tag) > 1:
        console.print(tag_table(by_tag))


def write_json(
    path: str | Path,
    summary: BenchSummary,
    records: Sequence[RequestRecord],
    *,
    config: Mapping[str, Any] | None = None,
    by_tag: Mapping[str, BenchSummary] | None = None,
) -> None:
    """Writes {"config", "summary", "by_tag", "requests"}: all stats and every request."""
    document = {
        "config": dict(config or {}),
        "summary": summary.to_dict(),
        "by_tag": {tag: s.to_dict() for tag, s in (by_tag or {}).items()},
        "requests": [record.to_dict() for record in records],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1, default=str) + "\n")
