"""Deployment: the model, GPU and engine settings every simulated worker of a plan shares, and
the sim engines made from them.

An engine is pdserve's own `LLMEngine` with the sim executor (pdserve/sim): the scheduler,
block manager and prefix cache run unchanged, the timing profile gives each step's duration,
and the executor's sleep is a no-op: the planner's event loop advances its virtual clock by
the step time instead (`StepMeter` reads it off the timing model as the executor asks for it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

from pdserve.config import default_cache_dir
from pdserve.core import model_limits
from pdserve.core.kv_events import KVEventSink
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SimConfig
from pdserve.sim.executor import SimExecutor, read_model_config
from pdserve.sim.gpus import gpu_spec
from pdserve.sim.model_shape import gpu_kv_blocks
from pdserve.sim.profiles import parse_profile
from pdserve.sim.shapes import SHAPES, shape_config
from pdserve.sim.timing import StepTiming, StepWork
from pdserve.tokenizer import Tokenizer


class StepMeter:
    """The sim executor's timing model, counting what it was asked: the modelled seconds and
    the prompt tokens of every step so far."""

    def __init__(self, timing: StepTiming) -> None:
        self.timing = timing
        self.seconds = 0.0
        self.prefill_tokens = 0

    def step_seconds(self, work: StepWork) -> float:
        seconds = self.timing.step_seconds(work)
        self.seconds += seconds
        self.prefill_tokens += work.prefill_tokens  # 0 in a step of decodes only
        return seconds

    def min_sampling_step_seconds(self) -> float:
        return self.timing.min_sampling_step_seconds()


def resolve_model(spec: str) -> Path:
    """A model directory (config.json and tokenizer), or a published shape by name written as a
    config-only directory under the cache (as `pdserve make-model --config-only` does)."""
    path = Path(spec)
    if path.is_dir():
        return path
    if spec not in SHAPES:
        known = ", ".join(SHAPES)
        raise ValueError(f"--model {spec!r}: neither a model directory nor a known shape ({known})")
    directory = default_cache_dir() / "sim-models" / spec
    if not (directory / "tokenizer.json").is_file():
        from pdserve.models.tokenizer_builder import write_tokenizer

        config = shape_config(spec)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        write_tokenizer(directory, config["vocab_size"])
    return directory


class Deployment:
    def __init__(
        self,
        model: str,
        *,
        gpu: str = "h100",
        tp: int = 1,
        profile: str | None = None,
        dtype: str = "bfloat16",
        link_gbps: float = 400.0,
        push_fixed_s: float = 0.0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
    ) -> None:
        """ValueError (ProfileError, ConfigError, KeyError for the GPU) names what is wrong."""
        gpu_spec(gpu)
        self.model_dir = resolve_model(model)
        self.model_config = read_model_config(self.model_dir)
        self.gpu, self.tp = gpu.lower(), tp
        self.profile = profile or f"analytical:{self.gpu}:tp{tp}"
        parse_profile(self.profile)
        blocks = num_kv_blocks or gpu_kv_blocks(self.model_config, gpu, tp, dtype, block_size)
        self.engine_config = EngineConfig(
            model=str(self.model_dir),
            kind="sim",
            dtype=dtype,
            block_size=block_size,
            num_kv_blocks=blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            sim=SimConfig(profile=self.profile, link_gbps=link_gbps),
        )
        # The prefill pool's deployment when it runs at another TP (with_prefill_pool).
        self.prefill_pool: Deployment = self
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.link_bytes_per_s = link_gbps * 1e9 / 8
        # What a KV push costs besides its bytes (its RPCs, the commit's round trip): 0 on the
        # analytical GPU profiles; measured where the real pushes were (bench layout-ranking).
        self.push_fixed_s = push_fixed_s
        # Longest prompt + output a worker serves.
        self.max_model_len = model_limits.max_model_len(self.model_config, self.engine_config)

    def push_seconds(self, num_bytes: int) -> float:
        """A KV push's (or a peer pull's) time on the link between two workers."""
        return self.push_fixed_s + num_bytes / self.link_bytes_per_s

    def with_prefill_pool(self, prefill: Deployment) -> Deployment:
        """This deployment for the decode (and colocated) workers, `prefill`'s (its TP, timing
        profile and KV pool) for the prefill workers."""
        both = copy.copy(self)
        both.prefill_pool = prefill
        return both

    def with_engine(self, **changes) -> Deployment:
        """This deployment with engine settings changed (the KV tiers of `bench sim-kv-tiers`);
        ConfigError names a bad one."""
        changed = copy.copy(self)
        changed.engine_config = dataclasses.replace(self.engine_config, **changes)
        if self.prefill_pool is self:
            changed.prefill_pool = changed
        return changed

    def for_role(self, role: str) -> Deployment:
        """What the workers of `role` run."""
        return self.prefill_pool if role == "prefill" else self

    def new_engine(self, kv_event_sink: KVEventSink | None = None) -> tuple[LLMEngine, StepMeter]:
        """A fresh sim engine that never sleeps, and the meter of its modelled steps;
        `kv_event_sink` gets its KV events (the planner's VirtualIndex)."""
        config, tokenizer = self.engine_config, self.tokenizer
        special = {*tokenizer.eos_token_ids, tokenizer.bos_token_id} - {None}
        executor = SimExecutor(
            self.model_config,
            num_blocks=model_limits.kv_pool_blocks(self.model_config, config),
            block_size=config.block_size,
            dtype=config.dtype,
            profile=config.sim.profile,
            avoid_token_ids=special,
            link_gbps=config.sim.link_gbps,
            sleep=_no_sleep,
        )
        engine = LLMEngine(
            config, kv_event_sink, executor=executor, emit_text=False, tokenizer=tokenizer
        )
        # After the engine: its KV tiers (--kv-offload-gb) add their transfers to the timing.
        meter = StepMeter(executor.timing)
        executor.timing = meter
        return engine, meter


class PoolDeployments:
    """The deployment of each split whose pools run at their own TPs (`pdserve plan
    --prefill-tp/--decode-tp`): the decode TP's deployment with the prefill TP's as its prefill
    pool, made once per pair. A class, not a closure: the planner's worker processes are
    given it pickled."""

    def __init__(self, by_tp: dict[int, Deployment]) -> None:
        self.by_tp = by_tp
        self.pools: dict[tuple[int, int], Deployment] = {}

    def __call__(self, split) -> Deployment:  # split: planner.probe.Split
        tps = (split.prefill_tp, split.decode_tp)
        if tps not in self.pools:
            decode, prefill = self.by_tp[split.decode_tp], self.by_tp[split.prefill_tp]
            self.pools[tps] = decode.with_prefill_pool(prefill)
        return self.pools[tps]


def _no_sleep(seconds: float) -> None:
    """The virtual clock moves by the modelled step time, not by waiting."""
