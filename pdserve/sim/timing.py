"""Step-time models: how long one engine step takes on the modelled hardware.

A step is described by `StepWork` (the chunks the scheduler picked); a model maps it to seconds
of simulated time. `AnalyticalTiming` is a roofline over a GPU's spec sheet (docs/simulation.md
derives it); `LinearTiming` applies coefficients fitted on a real engine, and may carry the
`StepSpread` of that engine's served steps around the fit (the sim executor walks it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Protocol

from pdserve.sim.gpus import GPUSpec
from pdserve.sim.model_shape import ModelShape

# Fixed cost of launching one all-reduce: NCCL's cost model (NVIDIA/nccl src/graph/tuning.cc,
# `baseLat`, Ring with the LL protocol) starts every ring all-reduce at 3.6 us, then adds a
# hop latency per ring step (gpus.py).
ALL_REDUCE_BASE_S = 3.6e-6


class Chunk(NamedTuple):
    """One sequence's share of a step: `new` tokens computed after `start` already in context.
    (A named tuple, immutable: the sim executor makes one per scheduled sequence per step,
    millions in a plan, and a tuple is made in ~0.3 us where a frozen dataclass takes ~0.55.)"""

    start: int
    new: int
    decode: bool  # a single generated token (not a prompt chunk)


@dataclass(frozen=True)
class StepWork:
    chunks: tuple[Chunk, ...]
    num_sampled: int  # sequences that sample a token this step (the LM head runs for these)
    # Totals over the chunks, summed in one pass when the work is made: a timing model reads
    # several of them per step, and the planner times millions of steps.
    new_tokens: int = field(init=False, repr=False, compare=False)
    prefill_tokens: int = field(init=False, repr=False, compare=False)
    decode_seqs: int = field(init=False, repr=False, compare=False)
    # KV entries attention reads: every sequence's whole context after this step.
    context_tokens: int = field(init=False, repr=False, compare=False)
    # Causal (query, key) pairs: a new token at position p attends to p + 1 keys.
    attention_pairs: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        new = prefill = decode_seqs = context = pairs = 0
        for start, n, decode in self.chunks:
            new += n
            if decode:
                decode_seqs += 1
            else:
                prefill += n
            context += start + n
            pairs += n * start + n * (n + 1) // 2
        totals = {
            "new_tokens": new,
            "prefill_tokens": prefill,
            "decode_seqs": decode_seqs,
            "context_tokens": context,
            "attention_pairs": pairs,
        }
        for name, value in totals.items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, chunks: Iterable[Chunk], num_sampled: int) -> StepWork:
        return cls(tuple(chunks), num_sampled)


class StepTiming(Protocol):
    def step_seconds(self, work: StepWork) -> float: ...

    def min_sampling_step_seconds(self) -> float:
        """A lower bound on the seconds of any step that samples a token (0: none known)."""
        ...


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the spec-sheet peaks a serving engine reaches (assumptions: see the docs)."""

    compute: float = 0.6  # of peak dense FLOP/s, in large prefill batches
    memory: float = 0.8  # of HBM bandwidth, in decode steps
    link: float = 0.7  # of NVLink/PCIe bandwidth, in TP all-reduces
    step_overhead_s: float = 0.001  # launch and scheduling cost of one step


# Tokens on the busiest GPU's experts over the mean (max / mean load) of a mixture of experts:
# an assumption, not a measurement: what remains after a load balancer such as DeepSeek's EPLB
# (redundant copies of hot experts); 1 = perfectly even routing.
DEFAULT_EXPERT_IMBALANCE = 1.2


@dataclass(frozen=True)
class AnalyticalTiming:
    """Roofline: a step takes the longer of its compute and memory times, plus the TP
    all-reduces and a fixed overhead. Work and bytes split evenly over `tp` GPUs; a mixture of
    experts' routed-expert FLOPs scaled by `expert_imbalance` (the busiest GPU sets the step),
    and a step reads only the experts its tokens touch (ModelShape.step_weight_bytes)."""

    shape: ModelShape
    gpu: GPUSpec
    tp: int = 1
    efficiency: Efficiency = Efficiency()
    expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE

    def step_seconds(self, work: StepWork) -> float:
        if not work.chunks:
            return 0.0
        s, eff = self.shape, self.efficiency
        kv_bytes = s.kv_bytes_per_token * (work.context_tokens + work.new_tokens)
        weights = s.step_weight_bytes(work.new_tokens)
        memory = (weights + kv_bytes) / (self.tp * self.gpu.hbm_bytes_per_s * eff.memory)
        compute = self.compute_seconds(work)
        return max(compute, memory) + self._all_reduce_seconds(work) + eff.step_overhead_s

    def compute_seconds(self, work: StepWork) -> float:
        """The step's FLOPs at the efficiency's share of peak: a lower bound on its time."""
        s = self.shape
        routed = s.routed_active_params * self.expert_imbalance
        flops = (
            2 * (s.body_params - s.routed_active_params + routed) * work.new_tokens
            + 2 * s.lm_head_params * work.num_sampled
            + s.attention_flops_per_pair * work.attention_pairs
        )
        return flops / (self.tp * self.gpu.bf16_flops * self.efficiency.compute)

    def min_sampling_step_seconds(self) -> float:
        """The step of one new token after an empty context, sampling it. A step that samples
        computes at least one token of at least one chunk, so its new tokens, sampled rows,
        attention pairs and context tokens are each at least this one's, and every term of
        `step_seconds` grows with them: no step that samples is shorter."""
        return self.step_seconds(StepWork((Chunk(0, 1, True),), 1))

    def _all_reduce_seconds(self, work: StepWork) -> float:
        """Two ring all-reduces of the hidden states per layer (after attention and MLP, the
        row-parallel o_proj and down_proj). A ring all-reduce of S bytes over N GPUs takes
        2(N - 1) steps, each moving S/N bytes per GPU (a reduce-scatter, then an all-gather):
        2(N - 1)/N x S / bandwidth, plus NCCL's base latency and one hop latency per step."""
        n = self.tp
        if n == 1:
            return 0.0
        size = work.new_tokens * self.shape.hidden * self.shape.dtype_bytes
        bandwidth = self.gpu.link_bytes_per_s * self.efficiency.link
        steps = 2 * (n - 1)
        per_reduce = steps / n * size / bandwidth + ALL_REDUCE_BASE_S + steps * self.gpu.link_hop_s
        return 2 * self.shape.layers * per_reduce


# Prefill steps are matched to measured ones of a like size: size classes half an octave wide of
# the fitted seconds (a 512-token chunk and a 64-token prompt differ ~6x). A class replays its
# own entries only when it holds enough of them for a spread (a handful walked round and round
# would repeat one burst); a step of a class with fewer takes the nearest class that has.
# Decode steps are not: their ratio followed what else the worker's core did more than their
# size, and by size a calibration's long-context decodes, run amid 1024-token prompts' KV, put
# a workload of long prompts at 1.26x its real decode time against 0.98x with one table (one calibration, 2026-11-29; docs/simulation.md).
SIZE_CLASSES_PER_OCTAVE = 2
MIN_CLASS_ENTRIES = 32


def size_class(fitted_s: float) -> int:
    """The half octave of `fitted_s` (seconds a fit predicts for a step); 0 s is in the lowest."""
    if fitted_s <= 0:
        return -(10**6)
    return math.floor(SIZE_CLASSES_PER_OCTAVE * math.log2(fitted_s))


@dataclass(frozen=True)
class StepSpread:
    """How a served engine's steps scattered around its fitted mean, measured in calibration
    (issue 14 point 3: the tails of a real system come from slow steps a mean never shows).

    Each table holds one entry per measured step, in recorded order: (measured / fitted
    seconds, seconds from the previous step's end to its start when the two shared a request,
    else 0, and the fitted seconds of the step). That gap is the engine loop's own work between
    steps and whatever else took the worker's core meanwhile (its event loop thread streaming
    tokens, Ray calls); a step and the gap before it are kept together, so whatever ties the two
    stays as measured. A sim executor walks, in order from a seeded position and wrapping
    around, the entries of its step's kind and, for a prefill, size class (issue 49 point 0: a
    prefill's ratio depends on its size: on a CPU a 768-token prefill ran at x0.66 of a fit
    where 64-token prompts ran at x1.1, and replaying a calibration's mix onto another
    workload's prompts misplaced them): its steps get the measured distribution and the
    measured runs of slow steps (a neighbour's burst of work on the core slows many steps in a
    row, and such runs, not single slow steps, move a request's TPOT). An entry without its
    fitted seconds (profiles written before they were kept) has no size: such a table is one
    class.
    Empty: not measured, no spread (every step lasts the mean, as before)."""

    decode: tuple[tuple[float, ...], ...] = ()  # steps without prompt tokens
    prefill: tuple[tuple[float, ...], ...] = ()  # steps with prompt tokens
    seed: int = 0

    def table(self, work: StepWork, fitted_s: float) -> tuple[str, tuple[tuple[float, float], ...]]:
        """(a name of the table, its (ratio, gap) entries) of measured steps like `work`, which
        the fit gives `fitted_s`: of its kind and, for a prefill, of the nearest size class with
        enough entries."""
        kind = "prefill" if work.prefill_tokens else "decode"
        classes = self._classes[kind]
        if len(classes) == 1:
            (only,) = classes.items()
            return f"{kind} {only[0]}", only[1]
        wanted = size_class(fitted_s)
        nearest = min(classes, key=lambda c: (abs(c - wanted), c))
        return f"{kind} {nearest}", classes[nearest]

    @cached_property
    def _classes(self) -> dict[str, dict[int | None, tuple[tuple[float, float], ...]]]:
        """Per kind: {size class: its (ratio, gap) entries in recorded order}, the prefill
        classes with at least MIN_CLASS_ENTRIES; all entries as class None for decode steps, and
        for prefills when no class has that many (or an entry has no size)."""
        grouped = {}
        for kind, entries in (("decode", self.decode), ("prefill", self.prefill)):
            whole = {None: tuple((e[0], e[1]) for e in entries)}
            if kind == "decode" or any(len(e) < 3 for e in entries):
                grouped[kind] = whole
                continue
            by_class: dict[int | None, list[tuple[float, float]]] = {}
            for ratio, gap, fitted_s in entries:
                by_class.setdefault(size_class(fitted_s), []).append((ratio, gap))
            rich = {c: tuple(e) for c, e in by_class.items() if len(e) >= MIN_CLASS_ENTRIES}
            grouped[kind] = rich if rich else whole
        return grouped


@dataclass(frozen=True)
class LinearTiming:
    """step = step_s + prefill_token_s * prefill tokens + decode_seq_s * decode sequences
    + context_token_s * context tokens read + prefill_step_s if the step computes any prompt
    tokens: the per-step cost coefficients of a real engine. `prefill_step_s` is what an eager
    engine's step pays for holding prompt chunks at all, whatever their length: the prompt rows'
    attention runs as its own kernels beside the decode rows' in every layer (measured on an
    H200 with the 8B shape: ~17 ms over a ~19 ms decode step; files without it have 0).
    `step_seconds` is the fitted mean; `spread`, when measured, is how the steps scattered."""

    step_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    prefill_step_s: float = 0.0
    spread: StepSpread | None = None

    def step_seconds(self, work: StepWork) -> float:
        if not work.chunks:
            return 0.0
        seconds = (
            self.step_s
            + self.prefill_token_s * work.prefill_tokens
            + self.decode_seq_s * work.decode_seqs
            + self.context_token_s * work.context_tokens
        )
        return seconds + self.prefill_step_s if work.prefill_tokens else seconds

    def min_sampling_step_seconds(self) -> float:
        """A step that samples computes at least one prompt token or one decode sequence and
        reads at least one context token: with no negative coefficient, no such step is
        shorter than this. A fit with a negative one bounds nothing (0)."""
        coefficients = (
            self.step_s,
            self.prefill_token_s,
            self.decode_seq_s,
            self.context_token_s,
            self.prefill_step_s,
        )
        if min(coefficients) < 0:
            return 0.0
        prefill = self.prefill_token_s + self.prefill_step_s
        return self.step_s + min(prefill, self.decode_seq_s) + self.context_token_s
