"""Latency CDF plots (PNG) of a serving benchmark, one file per metric."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from pdserve.workloads.metrics import RequestRecord


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Milliseconds per metric over completed requests: TTFT, TPOT, ITL, E2E."""
    done = [r for r in records if r.ok]
    seconds = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itls],
        "e2e": [r.e2e for r in done if r.e2e is not None],
    }
    return {name: [s * 1000.0 for s in values] for name, values in seconds.items()}


def plot_cdfs(
    records: Sequence[RequestRecord] | Mapping[str, Sequence[RequestRecord]],
    out_dir: str | Path,
    slo_ms: Mapping[str, float] | None = None,
) -> list[Path]:
    """Writes `<out_dir>/{ttft,tpot,itl,e2e}_cdf.png` and returns their paths.

    `records` may be one run, or runs by label (one curve each, e.g. baseline vs candidate).
    `slo_ms` draws a vertical line per metric name (e.g. {"ttft": 200}).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    runs = records if isinstance(records, Mapping) else {"": records}
    samples = {label: latency_samples(run) for label, run in runs.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric in ("ttft", "tpot", "itl", "e2e"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, by_metric in samples.items():
            values = np.sort(by_metric[metric])
            if len(values):
                fraction = np.arange(1, len(values) + 1) / len(values)
                ax.step(values, fraction, where="post", label=label or None)
        if slo_ms and metric in slo_ms:
            ax.axvline(
                slo_ms[metric], color="red", linestyle="--", label=f"SLO {slo_ms[metric]:g} ms"
            )
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{metric.upper()} CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        path = out / f"{metric}_cdf.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def plot_attainment(
    curves: Mapping[str, Mapping[float, float]], path: str | Path, target: float = 0.9
) -> Path:
    """Writes one PNG of SLO attainment against request rate, a curve per label, with the
    goodput target as a horizontal line; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, by_rate in curves.items():
        rates = sorted(by_rate)
        ax.plot(rates, [100 * by_rate[r] for r in rates], marker="o", label=label)
    ax.axhline(100 * target, color="red", linestyle="--", label=f"target {target:.0%}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out
