"""OnlinePlanner (`pdserve serve --plan-interval S`): every S seconds, the prefill/decode split
the planner would choose for the traffic of the last window, priced with this router's own
measured costs — logged, exported as metrics and written to Redis for `pdserve stats`.

The planner (pdserve/planner) simulates pdserve's engines, so the router cannot import it (an
import-linter contract: the router imports no engine); it runs as a child process at low CPU
priority, `python -m pdserve.planner.online`, fed one JSON window (pdserve/planner/online.py
says what the window holds and how the measured lines become a timing profile). A plan that
takes longer than four intervals (at least a minute) is abandoned; the router never waits
for one, and the next window is planned an interval after the last plan ended.

The result is the signal an autoscaler would act on: `pdserve_planner_workers{role}` (the
split for the live worker count), `pdserve_planner_goodput_rps` against
`pdserve_planner_observed_rps`, and `pdserve_planner_workers_needed` (the worker count the
observed rate needs if goodput scales with workers). With --role-switching the router acts on
the split itself (router/role_switch.py, a listener of every plan); resizing pools is not done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve import metrics
from router.cost_model import CostModel
from router.traffic_window import SERVED, ServedTraffic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanSettings:
    """What the planner needs to know of the deployment besides the traffic and costs."""

    model_dir: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    dtype: str
    ttft_slo_ms: float
    tpot_slo_ms: float


class OnlinePlanner:
    def __init__(
        self,
        interval_s: float,
        settings: PlanSettings,
        cost: CostModel,
        workers: Callable[[], list[Any]],  # the live workers' latest WorkerStats
        *,
        traffic: ServedTraffic = SERVED,
        publish: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.settings = settings
        self.cost = cost
        self.workers = workers
        self.traffic = traffic
        self.publish = publish
        self.latest: dict[str, Any] | None = None  # the last plan made (or its error)
        # Called with every plan made (or its error), e.g. RoleSwitcher.on_plan.
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._task: asyncio.Task | None = None

    def start(self) -> OnlinePlanner:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.plan_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a planner failure must never take the router down
                log.exception("online planner failed")

    def window(self) -> dict[str, Any] | None:
        """The JSON window the planner child reads; None without traffic or workers."""
        stats = [s for s in self.workers() if s is not None]
        served = self.traffic.window(self.interval_s)
        if not stats or len(served) < 2:
            return None
        s = self.settings
        prefill_a, prefill_b = self.cost.prefill.coefficients
        step_a, step_b = self.cost.decode.coefficients
        span = served[-1][2] - served[0][2]
        return {
            "model": s.model_dir,
            "workers": len(stats),
            "requests": served,
            "window_s": max(span, 1e-3),
            "prefill_token_s": prefill_b,
            "step_s": step_a,
            "decode_seq_s": step_b,
            "num_kv_blocks": min(x.num_blocks for x in stats),
            "block_size": s.block_size,
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "dtype": s.dtype,
            "ttft_slo_ms": s.ttft_slo_ms,
            "tpot_slo_ms": s.tpot_slo_ms,
            "extra": {"planned_at": time.time(), "window_interval_s": self.interval_s},
        }

    async def plan_once(self) -> dict[str, Any] | None:
        """Plans the current window in a child process; the plan (or {"error": ...}), or None
        when there was nothing to plan."""
        window = self.window()
        if window is None:
            return None
        answer = await _run_planner(window, timeout_s=max(60.0, 4 * self.interval_s))
        self.latest = answer
        if "error" in answer:
            log.warning("online planner: %s", answer["error"])
        else:
            log.info(
                "online planner: %s for %d workers (goodput %.2f req/s, observed %.2f req/s, "
                "%s workers for the observed rate)",
                answer["recommended"],
                answer["workers"],
                answer["goodput_rps"],
                answer["observed_rps"],
                answer["workers_for_observed"],
            )
            metrics.observe_plan(answer)
        if self.publish is not None:
            self.publish(answer)
        for listener in self.listeners:
            listener(answer)
        return answer


async def _run_planner(window: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdserve.planner.online",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=lambda: os.nice(10),  # the router's serving threads come first
    )
    try:
        out, err = await asyncio.wait_for(
            process.communicate(json.dumps(window).encode()), timeout_s
        )
    except TimeoutError:
        process.kill()
        await process.wait()
        return {"error": f"planning took longer than {timeout_s:g} s; abandoned"}
    if process.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"error": f"planner exited {process.returncode}: {tail[0]}"}
    try:
        return json.loads(out)
    except ValueError:
        return {"error": "planner printed no JSON"}
