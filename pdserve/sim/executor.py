"""SimExecutor: the engine's executor seam without a model (the torch one: model_runner.py).

The engine's scheduler, block manager and prefix cache run as they do on the torch path; this
executor produces each sampled token with `tokens.sim_token` and makes the step last what the
timing model says: it sleeps until `step_started + modelled * time_scale` (Python work already
done counts). Steps whose Python work alone overran the scaled model are counted: a benchmark
refuses figures from a saturated CPU. Imports neither torch nor the rest of pdserve.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.sim.kv import SimKVCache, SimulatedKV
from pdserve.sim.model_shape import DTYPE_BYTES, ModelShape
from pdserve.sim.profiles import parse_profile, timing_model
from pdserve.sim.timing import Chunk, StepWork
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
    return Chunk(start, num_tokens, decode=decode)


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
        self.timing = timing_model(parse_profile(profile), model_config, dtype)
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
        chunks, sample_idx = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            chunks.append(scheduled_chunk(seq, n))
            if seq.num_computed_tokens + n == seq.num_tokens:
                sample_idx.append(i)
        # Forks of n > 1 requests sample from their parent's position, each with its own seed.
        sample_idx += range(len(batch.seqs), len(batch.seqs) + len(batch.fork_samples))
        tokens, logprobs = [], []
        for i in sample_idx:
            seq = batch.sampling_seq(i)
            token, logprob = sim_token(seq.token_ids, self._space, self._salt(seq))
            tokens.append(token)
            logprobs.append(logprob if seq.params.logprobs else None)
        modelled = self.timing.step_seconds(StepWork.of(chunks, len(sample_idx)))
        self._pace(step_started, modelled)
        return sample_idx, tokens, logprobs

    def _salt(self, seq: Any) -> tuple[int, int] | None:
        params = seq.params
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else self._random.getrandbits(63)
        return seed, params.seed_offset + seq.num_output_tokens

    def _pace(self, step_started: float, modelled: float) -> None:
        """Sleeps out the rest of the scaled modelled step; records both times in sim time."""
        deadline = step_started + modelled * self.time_scale
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            self._sleep(remaining)
        else:
            self._stats["sim_overrun_steps"] += 1
        measured = time.perf_counter() - step_started
        self._stats["sim_modelled_seconds"] += modelled
        self._stats["sim_measured_seconds"] += measured / self.time_scale

    def read_kv(self, block_ids: list[int], layer_start: int, layer_end: int) -> SimulatedKV:
        _, _, _, block_size, heads, head_dim = self.kv_cache.shape
        shape = (layer_end - layer_start, 2, len(block_ids), block_size, heads, head_dim)
        return SimulatedKV(
            shape, self.kv_cache.dtype, self.kv_cache.itemsize, self._link_seconds_per_byte
        )

    def write_kv(self, block_ids: list[int], layer_start: int, data: Any) -> None:
        """Received KV has nowhere to go: the simulated model never reads it."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """No bytes to copy; counted (copy-on-write of forks)."""
        self._stats["sim_block_copies"] += len(copies)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)
