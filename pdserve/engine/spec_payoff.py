"""Whether speculation pays, measured from the engine's own step times (no torch).

Acceptance alone cannot say: a verify step costs more than a plain one by an amount that
depends on the hardware and the batch (on a 2-core CPU a verify of 5 positions of one sequence
costs ~1.6 plain steps; at batch 8, 40 positions instead of 8 make the matmuls compute-bound),
so speculation pays when the tokens a verify step emits outweigh its measured cost.

`StepTimes` times every step that only decodes (no prefill chunk, no forks: their cost is not
the decode's). A plain step (no drafts) of B sequences adds to the recent plain times of batch
size B (the median of the last PLAIN_SAMPLES, robust to a load spike). A speculative step of B
sequences that emitted E tokens in T seconds would have taken E / B plain steps of that batch
size; over the last `window` speculative steps the measured speedup is
sum((E / B) * plain(B)) / sum(T). Speculation pays while it is at least 1.

The clock is the process's CPU time on a CPU device (the steps run on this process's threads;
elapsed time on a shared machine measures the neighbours as well) and elapsed time otherwise
(an accelerator's work is not this process's CPU time).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

PLAIN_SAMPLES = 5  # plain steps per batch size whose median is its plain cost
STALE_STEPS = 256  # a batch size's plain cost older than this many steps is measured again


def step_clock(device: str) -> Callable[[], float]:
    return time.process_time if device == "cpu" else time.perf_counter


class StepTimes:
    def __init__(self, window: int, clock: Callable[[], float]) -> None:
        self.window = window
        self.clock = clock
        self._plain: dict[int, deque[float]] = {}  # batch size -> recent plain step seconds
        self._plain_at: dict[int, int] = {}  # batch size -> the step of its last plain sample
        self._spec: deque[tuple[float, float]] = deque(maxlen=window)  # (plain-equivalent, T)
        self._step = 0
        self._started = 0.0
        self._batch = 0  # sequences of this step when it only decodes, else 0 (not timed)
        self._unjudged = 0  # speculative steps timed with no plain step of their batch size

    def start(self) -> None:
        self._step += 1
        self._batch = 0
        self._started = self.clock()

    def decoding(self, batch_size: int) -> None:
        """This step only decodes, `batch_size` sequences: time it."""
        self._batch = batch_size

    def finish(self, accepted: int, speculative: bool) -> None:
        """The step verified drafts (`speculative`) and accepted `accepted` of them: it
        emitted one token per sequence and those."""
        batch = self._batch
        if not batch:
            return
        seconds = self.clock() - self._started
        if not speculative:
            self._plain.setdefault(batch, deque(maxlen=PLAIN_SAMPLES)).append(seconds)
            self._plain_at[batch] = self._step
            self._unjudged = 0
        elif batch in self._plain:
            plain = statistics.median(self._plain[batch])
            self._spec.append(((batch + accepted) / batch * plain, seconds))
        else:
            self._unjudged += 1

    def wants_plain(self, batch_size: int) -> bool:
        """Whether the next step should run plain, to be timed: `window` speculative steps
        found no plain step of their batch size to be judged against, or its plain time is
        stale (contexts grew, the load changed)."""
        last = self._plain_at.get(batch_size)
        if last is None:
            return self._unjudged >= self.window
        return self._step - last > STALE_STEPS

    @property
    def judging(self) -> bool:
        """Whether this step was timed and a plain step of its batch size was: the measured
        speedup, not the acceptance rate, decides."""
        return bool(self._batch) and self._batch in self._plain

    def speedup(self, partial: bool = False) -> float | None:
        """Plain seconds over speculative seconds for the same tokens, over the last `window`
        speculative steps; None until that many (`partial`: one) were timed."""
        if len(self._spec) < (1 if partial else self.window):
            return None
        return sum(p for p, _ in self._spec) / max(sum(t for _, t in self._spec), 1e-12)

    def clear(self) -> None:
        """Forgets the speculative steps (after a pause: the next ones start a new window)."""
        self._spec.clear()
