"""SimExecutor: the engine's executor seam without a model (the torch one: model_runner.py).

The engine's scheduler, block manager and prefix cache run as they do on the torch path; this
executor produces each sampled token with `tokens.sim_token` and makes the step last what the
timing model says: it sleeps until `step_started + modelled * time_scale` (Python work already
done counts). A sleep wakes late (tens to hundreds of microseconds on a shared CPU, as much as a
small CPU decode step's fitted cost), so what a step overshoots its deadline by is owed by the
next one while the worker goes straight on (the next step shares a request): its deadline comes
that much earlier, and the sim's steps last the modelled total, not that plus every wake-up's
delay (issue 49 point 0: the owed time was 16 % of a fidelity run's steps). Steps whose Python
work alone overran the scaled model are counted: a benchmark refuses figures from a saturated
CPU. A measured profile with a `StepSpread` also scatters the steps as the measured engine's
did: each step takes the next entry of the table of its kind (and, for a prefill, its size
class), its modelled time is multiplied by the entry's measured / fitted ratio, and, if it
follows a step sharing a request, it starts no earlier than the entry's gap after that step's
end. Tables are walked in recorded order from a position the profile's seed and the table's
name pick (the same steps, the same times). Imports neither torch nor the rest of pdserve.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.sim.kv import SimKVCache, SimulatedKV
from pdserve.sim.kv_tiers import TierChargedTiming, TierCharges
from pdserve.sim.model_shape import DTYPE_BYTES, ModelShape
from pdserve.sim.profiles import parse_profile, timing_model
from pdserve.sim.timing import Chunk, LinearTiming, StepWork
from pdserve.sim.tokens import TokenSpace, sim_token

GBIT = 10**9 / 8  # bytes per second in one Gbit/s


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """config.json of `model_dir` (a config-only directory is enough); ValueError if unusable."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def scheduled_chunk(seq: Any, num_tokens: int) -> Chunk:
    """The step work of `num_tokens` scheduled for `seq` (not yet counted as computed): one
    token past the prompt is a decode, anything else a prompt chunk."""
    start = seq.num_computed_tokens
    decode = num_tokens == 1 and start >= seq.num_prompt_tokens
    # tuple.__new__ makes the named tuple without its Python-level __new__: ~0.13 us against
    # ~0.21 us by position (~0.30 with keywords), once per scheduled sequence per step.
    return tuple.__new__(Chunk, (start, num_tokens, decode))


class SimExecutor:
    def __init__(
        self,
        model_config: dict[str, Any],
        *,
        num_blocks: int,
        block_size: int,
        dtype: str,
        profile: str,
        avoid_token_ids: set[int],
        time_scale: float = 1.0,
        link_gbps: float = 400.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        shape = ModelShape.from_config(model_config, dtype)
        self.model_config = model_config
        self.vocab_size = shape.vocab
        self.num_layers = shape.layers
        self.kv_cache = SimKVCache(
            (shape.layers, 2, num_blocks, block_size, shape.kv_heads, shape.head_dim),
            dtype,
            DTYPE_BYTES[dtype],
        )
        parsed = parse_profile(profile)
        self.timing = timing_model(parsed, model_config, dtype)
        self._spread = parsed.spread if isinstance(parsed, LinearTiming) else None
        # Where the walk through each spread table is: {table name: position}.
        self._cursors: dict[str, int] = {}
        self._previous_step: tuple[float, list] | None = None  # (its end, its sequences)
        self._owed = 0.0  # wall seconds the steps so far overshot their deadlines by
        self.time_scale = time_scale
        self._link_seconds_per_byte = time_scale / (link_gbps * GBIT)
        self._space = TokenSpace(shape.vocab, avoid_token_ids)
        self._random = random.Random()
        self._sleep = sleep
        self._clock = clock  # the engine's step_started clock
        self._stats = {
            "sim_modelled_seconds": 0.0,
            "sim_measured_seconds": 0.0,
            "sim_overrun_steps": 0,
            # Of the modelled seconds, the measured gaps a step waited before it (a real step's
            # time excludes its gap: the sim's steps hold them, the real ones do not).
            "sim_gap_seconds": 0.0,
            "sim_block_copies": 0,
        }

    @property
    def bytes_per_block(self) -> int:
        return self.kv_cache.bytes_per_block

    def execute(
        self, batch: Any, step_started: float
    ) -> tuple[list[int], list[int], list[float | None]]:
        """(indices in batch.seqs that sample, their tokens, their log-probabilities) of a
        ScheduledBatch whose chunks are not counted as computed yet."""
        chunks, sample_idx, samplers = [], [], []
        # Once per scheduled sequence per step: fields, not properties (num_tokens).
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            chunks.append(scheduled_chunk(seq, n))
            if seq.num_computed_tokens + n == len(seq.token_ids):
                sample_idx.append(i)
                samplers.append(seq)
        # Forks of n > 1 requests sample from their parent's position, each with its own seed.
        forks = range(len(batch.seqs), len(batch.seqs) + len(batch.fork_samples))
        sample_idx += forks
        samplers += map(batch.sampling_seq, forks)
        tokens, logprobs = [], []
        space = self._space
        for seq in samplers:
            params = seq.params
            # A greedy request's token has no salt: no call for one (once per simulated token).
            salt = None if params.greedy else self._salt(seq)
            token, logprob = sim_token(seq.token_ids, space, salt)
            tokens.append(token)
            logprobs.append(logprob if params.logprobs else None)
        work = StepWork.of(chunks, len(sample_idx))
        modelled = self.timing.step_seconds(work)
        # Whether the engine loop went straight on from the previous step (they share a request):
        # only looked up when a gap or an overshoot depends on it (the planner's sim engines,
        # which never sleep, step millions of times).
        continues = (self._spread is not None or self._owed > 0) and self._continues(batch.seqs)
        if not continues:
            self._owed = 0.0  # idle or other requests in between: nobody waited on the overshoot
        if self._spread is None:
            self._pace(step_started, step_started, modelled)
        else:
            ratio, gap = self._next_entry(work, modelled)
            paced_from = step_started
            if continues:  # the measured gap, less the engine loop's Python work since then
                paced_from = max(step_started, self._previous_step[0] + gap * self.time_scale)
            self._pace(paced_from, step_started, modelled * ratio)
        self._previous_step = (self._clock(), batch.seqs)
        return sample_idx, tokens, logprobs

    def _salt(self, seq: Any) -> tuple[int, int]:
        """(seed, token index) of a sampled (not greedy) sequence's next token."""
        params = seq.params
        seed = params.seed if params.seed is not None else self._random.getrandbits(63)
        return seed, params.seed_offset + seq.num_output_tokens

    def _continues(self, seqs: list) -> bool:
        """Whether a step of `seqs` shares a request with the previous step: the engine loop
        went straight on (the case calibration measured gaps in)."""
        if self._previous_step is None:
            return False
        previous = {seq.request_id for seq in self._previous_step[1]}
        return any(seq.request_id in previous for seq in seqs)

    def _next_entry(self, work: StepWork, fitted_s: float) -> tuple[float, float]:
        """The next (ratio, gap) of the spread table of steps like `work` (its kind and, for a
        prefill, the size class of `fitted_s`), walked in recorded order and wrapping around
        from a position the seed picks; (1, 0) when that table is empty."""
        name, table = self._spread.table(work, fitted_s)
        if not table:
            return 1.0, 0.0
        if name not in self._cursors:
            # Seeded by the table's name, not by the order tables are first used: the token
            # salts' generator (`_random`) is apart, so tokens do not depend on the timing.
            self._cursors[name] = random.Random(f"{self._spread.seed} {name}").getrandbits(32)
        self._cursors[name] += 1
        return table[self._cursors[name] % len(table)]

    def _pace(self, paced_from: float, step_started: float, modelled: float) -> None:
        """Sleeps out the rest of the scaled modelled step from `paced_from` (the step's start,
        or later: a modelled gap before it), less what earlier steps owe; records both times in
        sim time."""
        deadline = paced_from + modelled * self.time_scale
        now = self._clock()
        if now >= deadline:
            self._stats["sim_overrun_steps"] += 1
        # Where the step would end had every step since the worker went busy ended on time.
        due = deadline - self._owed
        if due > now:
            self._sleep(due - now)
        ended = self._clock()
        # Owed on: how late this step ended against that (never a credit: a step that ends
        # early, its Python work done sooner, is not made up for by a longer next one).
        self._owed = max(0.0, ended - due)
        gap = (paced_from - step_started) / self.time_scale
        self._stats["sim_modelled_seconds"] += modelled + gap
        self._stats["sim_gap_seconds"] += gap
        self._stats["sim_measured_seconds"] += (ended - step_started) / self.time_scale

    def charge_tier_transfers(self) -> TierCharges:
        """What the host and disk tiers (kv_tiers.py) charge their transfers to: each step
        lasts its model's time plus the transfers owed when it runs."""
        charges = TierCharges()
        self.timing = TierChargedTiming(self.timing, charges)
        return charges

    def read_kv(self, block_ids: list[int], layer_start: int, layer_end: int) -> SimulatedKV:
        _, _, _, block_size, heads, head_dim = self.kv_cache.shape
        shape = (layer_end - layer_start, 2, len(block_ids), block_size, heads, head_dim)
        return SimulatedKV(
            shape, self.kv_cache.dtype, self.kv_cache.itemsize, self._link_seconds_per_byte
        )

    def write_kv(
        self, block_ids: list[int], layer_start: int, data: Any, head_start: int = 0
    ) -> None:
        """Received KV has nowhere to go: the simulated model never reads it."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """No bytes to copy; counted (copy-on-write of forks)."""
        self._stats["sim_block_copies"] += len(copies)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)
