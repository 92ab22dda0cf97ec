"""Serving metrics from client-side timestamps, with vLLM's definitions.

Per request (times from `time.perf_counter`, seconds):
- TTFT: send -> arrival of the first response carrying a token.
- E2E: send -> arrival of the last response carrying a token (vLLM's `latency`).
- TPOT: (E2E - TTFT) / (output_tokens - 1), only for requests with more than one token.
- ITL: gaps between successive token-carrying responses; one entry per response, whatever
  the number of tokens it carries (vLLM's choice: the gap a reader of the stream sees).
  Events that reach the client in one read of the stream are one response (openai_load), so
  a burst of events gives no 0 ms gaps. `token_itls` spreads each gap evenly over its
  response's tokens (the per-token ITL of vLLM's and SGLang's benchmarks).
Summary statistics are in milliseconds: mean, std, and percentiles by numpy's default
linear interpolation (`np.percentile(..., method="linear")`, as vLLM). Goodput of one run:
completed requests meeting every SLO given, divided by the benchmark duration. Goodput of a
rate sweep (DistServe's): the highest request rate whose SLO attainment (`slo_attainment`) is
at least the target, `goodput_rate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    index: int  # position in the workload
    request_id: str
    prompt_len: int
    max_tokens: int
    tag: str = ""
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of token-carrying responses
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those responses
    end_time: float | None = None  # the stream ended (OK or not)
    ok: bool = False
    error_code: str | None = None  # gRPC status name, or "FINISH_ABORT" for a server abort
    error: str = ""
    finish_reason: str | None = None
    cached_prompt_tokens: int = 0
    server_timings: dict[str, Any] = field(default_factory=dict)  # the last response's Timings

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] - self.send_time if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between token-carrying chunks (vLLM's `bench serve` ITL): one per chunk."""
        return np.diff(self.chunk_times).tolist()

    @property
    def token_itls(self) -> list[float]:
        """ITL per token (SGLang's `bench_serving`): a chunk's gap split evenly over the
        tokens it carries, so it measures the token rate, not how tokens were batched."""
        gaps = np.diff(self.chunk_times)
        return np.repeat(gaps / self.chunk_tokens[1:], self.chunk_tokens[1:]).tolist()

    def to_dict(self) -> dict[str, Any]:
        derived = {"output_tokens": self.output_tokens, "ttft": self.ttft, "tpot": self.tpot}
        return dataclasses.asdict(self) | derived | {"e2e": self.e2e}


@dataclass
class LatencyStats:
    """Distribution of one latency, in milliseconds; all zero when `count` is 0."""

    count: int = 0
    mean: float = 0.0
    std: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    min: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        if len(seconds) == 0:
            return cls()
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, PERCENTILES, method="linear").tolist()
        mean, std, low, high = (float(f(ms)) for f in (np.mean, np.std, np.min, np.max))
        return cls(len(ms), mean, std, p50, p90, p99, low, high)


@dataclass
class BenchSummary:
    """Everything `pdserve bench serve` reports about one run."""

    num_requests: int
    completed: int
    failed: int
    failures: dict[str, int]  # status code -> count
    duration_s: float
    total_input_tokens: int  # of completed requests
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    good_requests: int | None  # None when no SLO was given
    goodput: float | None  # good requests / s
    cached_prompt_tokens: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    token_itl: LatencyStats = field(default_factory=LatencyStats)  # RequestRecord.token_itls

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A completed request whose TTFT and TPOT are within the SLOs given (<=, as vLLM).

    A one-token request has no TPOT and meets any TPOT SLO.
    """
    if not record.ok or record.ttft is None:
        return False
    if slo_ttft_ms is not None and record.ttft * 1000.0 > slo_ttft_ms:
        return False
    tpot = record.tpot
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> BenchSummary:
    """Summary statistics of a run that took `duration_s` (first send to last completion)."""
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0  # an empty run has no rates
    done = [r for r in records if r.ok]
    failures: dict[str, int] = {}
    for record in records:
        if not record.ok:
            code = record.error_code or "UNKNOWN"
            failures[code] = failures.get(code, 0) + 1
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done) if has_slo else None
    return BenchSummary(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        failures=dict(sorted(failures.items())),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        good_requests=good,
        goodput=None if good is None else good * per_s,
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in done),
        ttft=LatencyStats.of([r.ttft for r in done if r.ttft is not None]),
        tpot=LatencyStats.of([r.tpot for r in done if r.tpot is not None]),
        itl=LatencyStats.of([gap for r in done for gap in r.itls]),
        e2e=LatencyStats.of([r.e2e for r in done if r.e2e is not None]),
        token_itl=LatencyStats.of([gap for r in done for gap in r.token_itls]),
    )


def run_duration(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first send to the last stream end: the denominator of throughputs."""
    sent = [r.send_time for r in records if r.end_time is not None]
    ended = [r.end_time for r in records if r.end_time is not None]
    return max(ended) - min(sent) if ended else 0.0


def summarize_by_tag(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, BenchSummary]:
    """One summary per request class (e.g. "long" / "short"), over the same duration."""
    tags = sorted({r.tag for r in records})
    return {
        tag: summarize([r for r in records if r.tag == tag], duration_s, slo_ttft_ms, slo_tpot_ms)
        for tag in tags
    }


def slo_attainment(
    records: Sequence[RequestRecord], slo_ttft_ms: float | None, slo_tpot_ms: float | None
) -> float:
    """The fraction of all requests, failed ones included (as misses), that met the SLOs."""
    if not records:
        return 0.0
    return sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records) / len(records)


def goodput_rate(attainment: Mapping[float, float], target: float = 0.9) -> float:
    """DistServe's goodput of a rate sweep: the request rate at which SLO attainment falls
    below `target`, on the piecewise-linear curve through the swept (rate, attainment) points
    in rate order, starting from (0, 1). The first crossing counts (a later recovery is noise,
    not capacity); when no swept rate falls below, the highest swept rate (a lower bound)."""
    previous_rate, previous = 0.0, 1.0
    for rate in sorted(attainment):
        value = attainment[rate]
        if value < target:
            if previous <= target:
                return previous_rate
            return previous_rate + (rate - previous_rate) * (previous - target) / (previous - value)
        previous_rate, previous = rate, value
    return previous_rate
