"""CostModel: what prefill, a decode step and a KV transfer cost, learned online.

Each cost is a line y = a + b*x (seconds against tokens, batch size or bytes) fitted by
exponentially-forgetting least squares with a ridge pull towards a prior line, so it gives sane
answers before any data (the prior) and follows the workers as their speed changes (forgetting).
Samples come from worker statistics (`observe_stats`, counters differentiated between polls) or
from per-request timings (`observe_request_prefill`, `observe_transfer`). Per-request prefill
samples, once any arrive, replace the poll-interval ones for that kind of prefill: an interval
lumps several prefills (and their per-step overheads) into one point, which inflates the
intercept and flattens the slope, so a cached prefix would look like it saves almost nothing.
A prefill worker's queue is priced by the poll intervals all the same, as a rate (seconds per
prompt token of its prompt steps): how fast a busy worker drains, which the per-request line,
measured on lone prompts, overstated.
Pure Python, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.engine_config import EngineConfig
from router.handoff_costs import HandoffCost


@dataclass
class LinearFit:
    """Online fit of seconds = intercept + slope * x.

    The prior line enters as `prior_weight` pseudo-observations at x = x_scale/2 and 3*x_scale/2
    that fade like real samples, so data takes over: with `decay` < 1 a sample's weight halves
    after ln(2)/(1-decay) newer samples. A faint ridge towards the prior that never fades keeps
    the fit well-posed when every sample has the same x (e.g. a decode batch that stays at 1).
    """

    prior_intercept: float
    prior_slope: float
    x_scale: float
    prior_weight: float = 2.0
    decay: float = 0.97
    samples: int = 0
    _sums: list[float] = field(default_factory=list)  # weight, x, y, xx, xy (weighted sums)
    _solved: tuple[float, float] | None = None  # cached coefficients; None after a new sample

    def __post_init__(self) -> None:
        self._sums = [0.0] * 5
        for x in (0.5 * self.x_scale, 1.5 * self.x_scale):
            self._add(x, self.prior_intercept + self.prior_slope * x, self.prior_weight / 2)

    def observe(self, x: float, y: float, weight: float = 1.0) -> None:
        if x < 0 or y < 0 or weight <= 0:
            return  # a counter reset (worker restart) or a clock step: not a measurement
        self._sums = [self.decay * s for s in self._sums]
        self._add(x, y, weight)
        self.samples += 1
        self._solved = None

    def _add(self, x: float, y: float, w: float) -> None:
        for i, term in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] += w * term

    @property
    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope), both >= 0: time never shrinks as work grows."""
        if self._solved is None:
            self._solved = self._solve()
        return self._solved

    def _solve(self) -> tuple[float, float]:
        s0, sx, sy, sxx, sxy = self._sums
        la = 1e-3 * self.prior_weight  # the faint ridge
        lb = la * self.x_scale**2
        # Normal equations of sum w (y - a - b x)^2 + la (a - a0)^2 + lb (b - b0)^2.
        m00, m01, m11 = s0 + la, sx, sxx + lb
        r0 = sy + la * self.prior_intercept
        r1 = sxy + lb * self.prior_slope
        det = m00 * m11 - m01 * m01
        a = (r0 * m11 - m01 * r1) / det
        b = (m00 * r1 - m01 * r0) / det
        if b < 0:
            # The samples cannot tell the slope (all about the same x, e.g. one warm-up prompt
            # length) and sit above the prior line, which tilts the fit downhill. A flat line
            # would say that work costs nothing (a cached prefix would save nothing); keep the
            # prior's shape instead, scaled to the measured level: least squares of y = s * prior.
            a0, b0 = self.prior_intercept, self.prior_slope
            # Over the real samples only: the prior's pseudo-points lie on the line anyway.
            w = self.prior_weight / 2 * self.decay**self.samples
            for x in (0.5 * self.x_scale, 1.5 * self.x_scale):
                s0, sx, sy = s0 - w, sx - w * x, sy - w * (a0 + b0 * x)
                sxx, sxy = sxx - w * x * x, sxy - w * x * (a0 + b0 * x)
            norm = a0 * a0 * s0 + 2 * a0 * b0 * sx + b0 * b0 * sxx
            scale = (a0 * sy + b0 * sxy) / norm if norm > 1e-12 else 0.0
            if scale > 0:
                return a0 * scale, b0 * scale
            b, a = 0.0, r0 / m00  # no usable prior shape: the slope clamped at 0
        if a < 0:  # refit the slope with the intercept clamped at 0
            a, b = 0.0, max(0.0, r1 / m11)
        return a, b

    def predict(self, x: float) -> float:
        a, b = self.coefficients
        return a + b * max(0.0, x)


# Per poll of a prefill worker: the weight the drain rate's older polls keep (a half-life of
# ~23 polls, a few seconds at the router's poll interval).
DRAIN_DECAY = 0.97
# Per poll of a worker: the weight its step time's older polls keep (`step_seconds`; a
# half-life of ~3 polls: the TPOT its batch sees now, not over the last minute).
STEP_DECAY = 0.8


@dataclass
class CostModel:
    """Costs of the pools. Priors are modest GPU-ish numbers; data replaces them within seconds.

    prefill: seconds of one prefill on a prefill worker vs tokens computed.
    local_prefill: the same on a decode worker (shares the GPU with decoding); estimates take
    the slower of it and `prefill`'s line (until it has data, `prefill`'s line alone).
    decode: seconds of one decode step vs batch size.
    transfer: seconds of one KV transfer vs bytes (intercept = latency, 1/slope = bandwidth).
    host_copy_bytes_per_s: the bandwidth of copying prefix-cache blocks back from a worker's
    host tier to its device (--kv-offload-gb), what a host hit costs (`hit_seconds`). The prior
    is a PCIe 4 x16 link's ~12 GB/s; each worker measures its own at start
    (WorkerStats.host_copy_bytes_per_s) and the latest measurement replaces it.
    handoff: the fixed seconds a remote prefill's round trips add to its TTFT
    (router/handoff_costs.py), which a local prefill does not pay.
    disk_read_bytes_per_s: the same for a worker's disk tier (--kv-disk-dir): file to device,
    checksum included. The prior is an NVMe drive's ~3 GB/s; workers measure their reads as
    they go (WorkerStats.disk_read_bytes_per_s) and the latest replaces it.
    """

    prefill: LinearFit = field(default_factory=lambda: LinearFit(0.01, 1e-4, x_scale=512))
    local_prefill: LinearFit = field(default_factory=lambda: LinearFit(0.01, 1e-4, x_scale=512))
    decode: LinearFit = field(default_factory=lambda: LinearFit(0.01, 2e-4, x_scale=16))
    transfer: LinearFit = field(default_factory=lambda: LinearFit(0.002, 1e-9, x_scale=16 << 20))
    handoff: HandoffCost = field(default_factory=HandoffCost)
    host_copy_bytes_per_s: float = 12e9
    disk_read_bytes_per_s: float = 3e9
    # Prompt tokens one engine step computes at most (EngineConfig.max_num_batched_tokens).
    step_tokens: int = EngineConfig.max_num_batched_tokens
    _last: dict[str, object] = field(default_factory=dict)  # worker_id -> previous stats
    _per_request: set[bool] = field(default_factory=set)  # `local` values measured per request
    # The prefill workers' seconds and prompt tokens in steps that computed prompts, summed over
    # their polls with DRAIN_DECAY's forgetting: how fast a queue of prompts drains there
    # (`prefill_queue_seconds`). [seconds, tokens]
    _drain: list[float] = field(default_factory=lambda: [0.0, 0.0])
    # Per worker, the seconds and steps of its recent polls with STEP_DECAY's forgetting
    # (`step_seconds`). worker_id -> [seconds, steps]
    _steps: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def with_priors_scaled(cls, factor: float) -> CostModel:
        """A fresh model whose every prior line (intercept and slope, in seconds) is `factor`
        times the default's: the same priors in another clock (the offline planner's simulated
        seconds for a live router's wall seconds at a time scale)."""
        cost = cls()
        for f in dataclasses.fields(cost):
            fit = getattr(cost, f.name)
            if isinstance(fit, LinearFit):
                setattr(cost, f.name, dataclasses.replace(
                    fit, prior_intercept=fit.prior_intercept * factor,
                    prior_slope=fit.prior_slope * factor,
                ))  # fmt: skip
        cost.handoff = cost.handoff.scaled(factor)
        return cost

    def observe_prefill(self, tokens: int, seconds: float, *, local: bool = False) -> None:
        (self.local_prefill if local else self.prefill).observe(tokens, seconds)

    def observe_request_prefill(self, tokens: int, seconds: float, *, local: bool = False) -> None:
        """One request's prefill: `tokens` computed (its uncached part) in `seconds`."""
        self._per_request.add(local)
        self.observe_prefill(max(1, tokens), seconds, local=local)

    def observe_decode_step(self, batch_size: float, seconds: float, weight: float = 1.0) -> None:
        self.decode.observe(batch_size, seconds, weight)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        self.transfer.observe(num_bytes, seconds)

    def observe_handoff(self, seconds: float) -> None:
        """One remote prefill's first answer came `seconds` later than its queue and compute."""
        self.handoff.observe(seconds)

    def observe_stats(self, stats) -> None:
        """Learns from a worker's cumulative counters (pdserve.core.messages.WorkerStats) by
        differencing them against the same worker's previous poll. A new epoch restarts it."""
        prev = self._last.get(stats.worker_id)
        self._last[stats.worker_id] = stats
        if getattr(stats, "disk_read_bytes_per_s", 0) > 0:
            self.disk_read_bytes_per_s = float(stats.disk_read_bytes_per_s)
        if prev is None or prev.epoch != stats.epoch:
            self._observe_host_copy(stats)
            return
        tokens = stats.prefill_tokens - prev.prefill_tokens
        seconds = stats.prefill_seconds - prev.prefill_seconds
        self._observe_steps(stats, prev)
        if tokens > 0 and seconds > 0 and stats.role == "prefill":
            self._drain = [DRAIN_DECAY * self._drain[0] + seconds,
                           DRAIN_DECAY * self._drain[1] + tokens]  # fmt: skip
        # A hybrid worker's prompt steps also decode: they measure a decode worker's line.
        local = stats.role != "prefill"
        if tokens > 0 and seconds > 0 and local not in self._per_request:
            # One sample per interval: a prefill of the interval's mean size per step is not
            # known, so the interval counts as one prefill of all its tokens.
            self.observe_prefill(tokens, seconds, local=local)
        steps = stats.decode_steps - prev.decode_steps
        decode_s = stats.decode_seconds - prev.decode_seconds
        if steps > 0 and decode_s > 0:
            batch = (stats.decode_tokens - prev.decode_tokens) / steps
            self.observe_decode_step(batch, decode_s / steps, weight=min(steps, 8))
        sent = stats.transfer_bytes - prev.transfer_bytes
        transfer_s = stats.transfer_seconds - prev.transfer_seconds
        # A prefill worker's handoffs, and a decode worker's peer pull pushes
        # (decode_service/prefix_push.py): the same transports, so one line prices both.
        if sent > 0 and transfer_s > 0:
            self.observe_transfer(sent, transfer_s)

    def _observe_steps(self, stats, prev) -> None:
        steps = (stats.decode_steps - prev.decode_steps) + (
            stats.prefill_steps - prev.prefill_steps
        )
        seconds = (stats.decode_seconds - prev.decode_seconds) + (
            stats.prefill_seconds - prev.prefill_seconds
        )
        if steps > 0 and seconds > 0:  # an idle interval says nothing of the next step
            was = self._steps.get(stats.worker_id, [0.0, 0.0])
            self._steps[stats.worker_id] = [STEP_DECAY * was[0] + seconds,
                                            STEP_DECAY * was[1] + steps]  # fmt: skip

    def step_seconds(self, worker_id: str) -> float | None:
        """The worker's mean step over its last few polls, prompt steps included (None before
        any): the TPOT its running requests see now, each one token per step, with the stalls
        of the prompts it computed. Measured, where `decode_step_seconds` predicts the step of
        a batch size from a line fitted over every worker's decode-only steps."""
        seconds, steps = self._steps.get(worker_id, (0.0, 0.0))
        return seconds / steps if steps else None

    def _observe_host_copy(self, stats) -> None:
        """A worker's host-to-device bandwidth, measured when it started (once per epoch)."""
        bandwidth = getattr(stats, "host_copy_bytes_per_s", 0)
        if bandwidth > 0:
            self.host_copy_bytes_per_s = float(bandwidth)

    # -- estimates ----------------------------------------------------------------------------

    def hit_seconds(self, tier: str, num_bytes: int) -> float:
        """What using `num_bytes` of cached KV held in `tier` costs before the prefill can
        start: nothing on the device, a copy back from host memory, a read from disk."""
        if tier == "device" or num_bytes <= 0:
            return 0.0
        if tier == "host":
            return num_bytes / self.host_copy_bytes_per_s
        if tier == "disk":
            return num_bytes / self.disk_read_bytes_per_s
        raise ValueError(f"unknown KV cache tier {tier!r}")

    def prefill_fits(self, local: bool) -> list[LinearFit]:
        """A decode worker shares its accelerator with decoding, so a prefill there is never
        taken to be faster than on a prefill worker: estimates use the slower of the two lines
        once both have data. They are measured differently (per request with overheads, vs
        engine step time from counters), and the local line alone would price local prefills
        below the same work on an idle prefill worker. A line without data is only its prior:
        in a colocated cluster the prefill workers' line never gets any, and its prior (4x an
        8B's H100 prefill) would price every local prefill and queue for ever."""
        if local and self.local_prefill.samples:
            if not self.prefill.samples:
                return [self.local_prefill]
            return [self.prefill, self.local_prefill]
        return [self.prefill]

    def prefill_seconds(self, tokens: int, *, local: bool = False) -> float:
        return max(fit.predict(tokens) for fit in self.prefill_fits(local))

    def stall_seconds(self, tokens: int) -> float:
        """What a local prefill of `tokens` adds to its decode worker's steps: the prefill's
        compute alone, the lower of the lines that measure it (`prefill_seconds(local=True)`
        takes the higher: a request's TTFT there also waits for the decode work its chunks
        share steps with, and a prefill worker's samples for its step in progress)."""
        return min(fit.predict(tokens) for fit in self.prefill_fits(local=True))

    def drain_seconds_per_token(self) -> float | None:
        """Seconds per prompt token of the prefill workers' steps that computed prompts, as
        measured over their polls (None before any): how fast a queue of prompts drains there.
        The per-request line (its intercept a request's own overheads, paid once per full step
        in `prefill_queue_seconds`) put 70B TP 4 queues at twice their wait, and `auto` kept
        short prompts local beside a TPOT-bound batch (docs/benchmarks/simulation.md)."""
        seconds, tokens = self._drain
        return seconds / tokens if tokens else None

    def prefill_queue_seconds(self, tokens: int, requests: int, *, local: bool = False) -> float:
        """Wait behind `requests` queued prompts holding `tokens` uncomputed tokens.

        A prefill worker's queue, once its polls have measured the drain: its tokens at that
        rate (`drain_seconds_per_token`). Otherwise (a decode worker's own queue, whose steps
        also decode, or before any poll), by the prefill lines: the engine packs waiting
        prompts into steps of up to `step_tokens` (chunked prefill), so a queue pays the fixed
        cost (the intercept) once per full step of its tokens, not once per request: a
        newcomer shares the last, partial step. A short prompt queued
        therefore adds only its tokens' time, and a worker holding a group's prefix stays the
        cheaper choice for the group's next request.
        """
        drain = None if local else self.drain_seconds_per_token()
        if drain is not None:
            return tokens * drain
        steps = min(requests, tokens // max(1, self.step_tokens))
        waits = []
        for fit in self.prefill_fits(local):
            a, b = fit.coefficients
            waits.append(a * steps + b * tokens)
        return max(waits)

    def decode_step_seconds(self, batch_size: int) -> float:
        return self.decode.predict(batch_size)

    def transfer_seconds(self, num_bytes: int) -> float:
        return self.transfer.predict(num_bytes)

    def handoff_seconds(self) -> float:
        return self.handoff.seconds
