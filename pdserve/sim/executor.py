"""SimExecutor: the engine's executor seam without a model (the torch one: model_runner.py).

The engine's scheduler, block manager and prefix cache run as they do on the torch path; this
executor produces each sampled token with `tokens.sim_token` and makes the step last what the
timing model says: it sleeps until `step_started + modelled * time_scale` (Python work already
done counts). Steps whose Python work alone overran the scaled model are counted: a benchmark
refuses figures from a saturated CPU. A measured profile with a `StepSpread` also scatters the
steps as the measured engine's did: each step takes the next entry of its kind's table, its
modelled time is multiplied by the entry's measured / fitted ratio, and, if it follows a step
sharing a request, it starts no earlier than the entry's gap after that step's end. Tables
are walked in recorded order from a position the profile's seed picks (the same steps, the
same times). Imports neither torch nor the rest of pdserve.
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
        # Where the walk through each spread table starts; a generator of its own, as the
        # token salts' (`_random`) must not depend on the timing.
        starts = random.Random(self._spread.seed if self._spread else 0)
        self._cursors = {name: starts.getrandbits(32) for name in ("decode", "prefill")}
        self._previous_step: tuple[float, set[str]] | None = None  # (its end, its requests)
        self.time_scale = time_scale
        self._link_seconds_per_byte = time_scale / (link_gbps * GBIT)
        self._space = TokenSpace(shape.vocab, avoid_token_ids)
        self._random = random.Random()
        self._sleep = sleep
        self._stats = {
            "sim_modelled_seconds": 0.0,
            "sim_measured_seconds": 0.0,
            "sim_overrun_steps": 0,
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
        if self._spread is None:
            self._pace(step_started, step_started, modelled)
            return sample_idx, tokens, logprobs
        requests = {seq.request_id for seq in batch.seqs}
        ratio, gap = self._next_entry(work)
        self._pace(self._after_gap(requests, gap, step_started), step_started, modelled * ratio)
        self._previous_step = (time.perf_counter(), requests)
        return sample_idx, tokens, logprobs

    def _salt(self, seq: Any) -> tuple[int, int]:
        """(seed, token index) of a sampled (not greedy) sequence's next token."""
        params = seq.params
        seed = params.seed if params.seed is not None else self._random.getrandbits(63)
        return seed, params.seed_offset + seq.num_output_tokens

    def _next_entry(self, work: StepWork) -> tuple[float, float]:
        """The next (ratio, gap) of the spread table of `work`'s kind, walked in recorded
        order and wrapping around; (1, 0) when that table is empty."""
        kind = "prefill" if work.prefill_tokens else "decode"
        table = self._spread.table(work)
        if not table:
            return 1.0, 0.0
        self._cursors[kind] += 1
        return table[self._cursors[kind] % len(table)]

    def _after_gap(self, requests: set[str], gap: float, step_started: float) -> float:
        """When the step may start: `gap` (scaled) after the previous step's end if the two
        share a request (the engine loop went straight on, the case calibration measured);
        its own start otherwise, or when the Python work since then took longer."""
        previous = self._previous_step
        if previous is None or not requests & previous[1]:
            return step_started
        return max(step_started, previous[0] + gap * self.time_scale)

    def _pace(self, paced_from: float, step_started: float, modelled: float) -> None:
        """Sleeps out the rest of the scaled modelled step from `paced_from` (the step's start,
        or later: a modelled gap before it); records both times in sim time."""
        deadline = paced_from + modelled * self.time_scale
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            self._sleep(remaining)
        else:
            self._stats["sim_overrun_steps"] += 1
        ended = time.perf_counter()
        self._stats["sim_modelled_seconds"] += (
            modelled + (paced_from - step_started) / self.time_scale
        )
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
