"""Whether speculation pays, measured from the engine's own step times (no torch).

Acceptance alone cannot say: a verify step costs more than a plain one by an amount that
depends on the hardware and the batch (on a 2-core CPU a verify of 5 positions of one sequence
costs ~1.6 plain steps; at batch 8, 40 positions instead of 8 make the matmuls compute-bound),
so speculation pays when the tokens a verify step emits outweigh its measured cost.

`StepTimes` times every step that only decodes (no prefill chunk, no forks: their cost is not
the decode's). A plain step (no drafts) of B sequences adds to the recent plain times of batch
size B (the median of the last PLAIN_SAMPLES, robust to a load spike). A speculative step of B
sequences that emitted E tokens in T seconds would have taken E / B plain steps of that batch
size; over the last `window` speculative steps, extended back to cover `sequences`
sequence-steps, the measured speedup is sum((E / B) * plain(B)) / sum(T). Speculation pays
while it is at least 1. The acceptance in it is a count: over 8 steps of one sequence, a
draft accepted 63% of the time at k = 1 (a 1.2x speedup in the mean) measured below 1 in one
window of every few, and the window slides every step, so a batch-1 judgment waits for 32
sequence-steps (BENCHMARKS.md, issue 17), unless the last `window` steps alone show a clear
loss (`recent_speedup` below CLEAR_LOSS).

`best_length` picks how many tokens to propose per sequence (at most k) from the same
measurements: each draft count's step time per batch size (`StepTimes.cost`) and the measured
chance that the i-th draft is accepted given the ones before it (`DraftAcceptance`), the
length with the most expected tokens per second (dynamic speculation length: docs/decoding.md).

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
MIN_COST_SAMPLES = 3  # timed steps of a draft count before its cost counts as measured
STALE_STEPS = 256  # a batch size's plain cost older than this many steps is measured again
JUDGED_SEQUENCES = 32  # sequence-steps a judged window covers at least (see above)


def step_clock(device: str) -> Callable[[], float]:
    return time.process_time if device == "cpu" else time.perf_counter


class StepTimes:
    def __init__(
        self, window: int, clock: Callable[[], float], sequences: int = JUDGED_SEQUENCES
    ) -> None:
        self.window = window
        self.sequences = sequences
        self.clock = clock
        self._plain: dict[int, deque[float]] = {}  # batch size -> recent plain step seconds
        self._plain_at: dict[int, int] = {}  # batch size -> the step of its last plain sample
        self._spec: deque[tuple[float, float, int]] = deque()  # (plain-equivalent, T, B)
        self._spec_sequences = 0  # sum of B over _spec
        self._step = 0
        self._started = 0.0
        self._batch = 0  # sequences of this step when it only decodes, else 0 (not timed)
        self._unjudged = 0  # speculative steps timed with no plain step of their batch size
        # (batch size, most drafts of one sequence) -> recent step seconds (best_length's costs)
        self._by_drafts: dict[tuple[int, int], deque[float]] = {}

    def start(self) -> None:
        self._step += 1
        self._batch = 0
        self._started = self.clock()

    def decoding(self, batch_size: int) -> None:
        """This step only decodes, `batch_size` sequences: time it."""
        self._batch = batch_size

    def finish(self, accepted: int, speculative: bool, drafts: int = 0) -> None:
        """The step verified drafts (`speculative`, at most `drafts` for one sequence) and
        accepted `accepted` of them: it emitted one token per sequence and those."""
        batch = self._batch
        if not batch:
            return
        seconds = self.clock() - self._started
        if speculative and drafts:
            key = (batch, drafts)
            self._by_drafts.setdefault(key, deque(maxlen=PLAIN_SAMPLES)).append(seconds)
        if not speculative:
            self._plain.setdefault(batch, deque(maxlen=PLAIN_SAMPLES)).append(seconds)
            self._plain_at[batch] = self._step
            self._unjudged = 0
        elif self._plain_known(batch):
            plain = statistics.median(self._plain[batch])
            self._spec.append(((batch + accepted) / batch * plain, seconds, batch))
            self._spec_sequences += batch
            while len(self._spec) > self.window and (
                self._spec_sequences - self._spec[0][2] >= self.sequences
            ):
                self._spec_sequences -= self._spec.popleft()[2]
        else:
            self._unjudged += 1

    def wants_plain(self, batch_size: int) -> bool:
        """Whether the next step should run plain, to be timed: `window` speculative steps
        found no plain step of their batch size to be judged against, or its plain time is
        stale (contexts grew, the load changed)."""
        last = self._plain_at.get(batch_size)
        if last is None:
            return self._unjudged >= self.window
        if not self._plain_known(batch_size):
            return True  # the first plain steps of a batch size run back to back
        return self._step - last > STALE_STEPS

    def _plain_known(self, batch_size: int) -> bool:
        """Whether batch_size's plain cost rests on MIN_COST_SAMPLES steps: one step may be a
        warm-up (a CUDA graph captured, a GEMM kernel loaded: 10-1000x a step), and a plain
        cost inflated by it would keep speculation on however little it pays."""
        return len(self._plain.get(batch_size, ())) >= MIN_COST_SAMPLES

    @property
    def judging(self) -> bool:
        """Whether this step was timed and a plain step of its batch size was: the measured
        speedup, not the acceptance rate, decides."""
        return bool(self._batch) and self._plain_known(self._batch)

    def speedup(self, partial: bool = False) -> float | None:
        """Plain seconds over speculative seconds for the same tokens, over the last `window`
        speculative steps (or more, to cover `sequences` sequence-steps); None until those
        (`partial`: one) were timed."""
        steps, sequences = (1, 0) if partial else (self.window, self.sequences)
        if len(self._spec) < steps or self._spec_sequences < sequences:
            return None
        return _speedup(self._spec)

    def recent_speedup(self) -> float | None:
        """The same over the last `window` speculative steps alone; None until that many were
        timed. Below CLEAR_LOSS it is the steps' cost, not an unlucky count of accepted
        tokens, so it need not wait for the whole window."""
        if len(self._spec) < self.window:
            return None
        return _speedup(list(self._spec)[-self.window :])

    def cost(self, batch_size: int, drafts: int) -> float | None:
        """Median recent seconds of a decode step of `batch_size` sequences with at most
        `drafts` drafts each (0: a plain step); None until enough were timed."""
        if drafts == 0:
            known = self._plain_known(batch_size)
            return statistics.median(self._plain[batch_size]) if known else None
        times = self._by_drafts.get((batch_size, drafts))
        # One step's time is noise on a loaded machine: a length is measured from 3 steps on.
        return statistics.median(times) if times and len(times) >= MIN_COST_SAMPLES else None

    def clear(self) -> None:
        """Forgets the speculative steps (after a pause: the next ones start a new window)."""
        self._spec.clear()
        self._spec_sequences = 0


def _speedup(steps) -> float:
    return sum(p for p, _, _ in steps) / max(sum(t for _, t, _ in steps), 1e-12)


# A speedup this low over SPEC_STEPS steps is a loss however the drafts fell: a k = 1 draft
# right 53% of the time, at 1.25 plain steps a step (1.2x in the mean), measures below it only
# when all 8 are rejected.
CLEAR_LOSS = 0.85
PAY_MARGIN = 1.05  # a length must promise 5% more tokens per second than plain decoding
ACCEPT_DECAY = 0.95  # weight of a draft position's older verifications per newer one


class DraftAcceptance:
    """How often the i-th draft of a sequence is accepted once the ones before it were
    (i = 1..k), over recent verifications (exponentially decayed), with a uniform prior."""

    def __init__(self, k: int) -> None:
        self._seen = [0.0] * k  # verifications that reached position i (decayed)
        self._taken = [0.0] * k  # of those, accepted

    def record(self, drafted: int, accepted: int) -> None:
        """One verification: positions 1..accepted accepted, the next one (if drafted)
        rejected, later ones never judged."""
        for i in range(min(accepted + 1, drafted, len(self._seen))):
            self._seen[i] = self._seen[i] * ACCEPT_DECAY + 1
            self._taken[i] = self._taken[i] * ACCEPT_DECAY + (i < accepted)

    def rates(self) -> list[float]:
        return [(t + 1) / (s + 2) for s, t in zip(self._seen, self._taken, strict=True)]


def best_length(k: int, rates: list[float], cost: Callable[[int], float | None]) -> int:
    """Drafts per sequence (1..k) with the most expected tokens per second: length j emits
    1 + sum_{i<=j} prod_{m<=i} rates[m-1] tokens per sequence in cost(j) seconds. An
    unmeasured cost is interpolated between the measured lengths around it (plain, cost(0),
    always counts), or taken equal to the longest measured below it, so a longer length is
    tried once. Returns k when plain decoding is unmeasured or no length beats it by
    PAY_MARGIN: whether to speculate at all is the switch-off's call, on full proposals (a
    length chosen at break-even would hover there, in the noise of a few timed steps)."""
    known = {j: c for j in range(k + 1) if (c := cost(j)) is not None}
    if 0 not in known:
        return k
    best, best_rate = k, PAY_MARGIN / max(known[0], 1e-12)
    reach = tokens = 1.0
    pays = False
    for j in range(1, k + 1):
        reach *= rates[j - 1]
        tokens += reach
        rate = tokens / max(_interpolated(known, j), 1e-12)
        if rate > best_rate or (pays and rate == best_rate):
            best, best_rate, pays = j, rate, True
    return best if pays else k


def _interpolated(known: dict[int, float], j: int) -> float:
    if j in known:
        return known[j]
    low = max(i for i in known if i < j)
    above = [i for i in known if i > j]
    if not above:
        return known[low]
    high = min(above)
    return known[low] + (known[high] - known[low]) * (j - low) / (high - low)
