"""The engine's executor seam: what runs the model for `LLMEngine`. `TorchExecutor`
(model_runner.py: the model, the KV cache tensor, the sampler) or, with `EngineConfig.kind ==
"sim"`, `pdserve.sim.executor.SimExecutor` (a timing model and deterministic tokens, no torch).
This module imports neither: the one `config.kind` names is imported when it is made."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pdserve.core import model_limits
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine_config import EngineConfig
from pdserve.tokenizer import Tokenizer


class Executor(Protocol):
    """What runs the model for the engine: computes a step's chunks and samples its tokens,
    and owns the KV cache (a tensor, or for the sim executor a shape without bytes).

    An executor whose `overlaps_steps` attribute is true also has `launch(batch, follows)` and
    `collect(launched)`: a step started without waiting for its tokens, and its tokens later
    (the torch one, model_runner.py; the engine's async scheduling,
    gpu_step/overlapped_steps.py)."""

    model_config: dict[str, Any]  # the HF config.json
    vocab_size: int
    num_layers: int
    kv_cache: Any  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    bytes_per_block: int

    def execute(
        self, batch: ScheduledBatch, step_started: float
    ) -> tuple[list[int], list[int], list[float | None]]:
        """Computes every scheduled chunk (their sequences' num_computed_tokens not advanced
        yet); returns the sample indices (batch.sampling_seq: batch.seqs, then the forks of
        batch.fork_samples, which sample from their parent's logits), their tokens and
        logprobs (None where a request did not ask). `step_started`: perf_counter at the
        step's start."""
        ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies every (source, destination) block's KV, all sources read before any write."""
        ...

    def read_kv(self, block_ids: list[int], layer_start: int, layer_end: int) -> Any: ...

    def write_kv(
        self, block_ids: list[int], layer_start: int, data: Any, head_start: int = 0
    ) -> None: ...

    def stats(self) -> dict[str, float]: ...


def make_executor(
    config: EngineConfig, model_dir: Path, tokenizer: Tokenizer, tensor_parallel: Any = None
) -> Executor:
    """The executor `config.kind` names; only the torch one imports torch. `tensor_parallel`:
    this process's models.tensor_parallel.TensorParallel rank when config.tp > 1."""
    if config.kind == "sim":
        from pdserve.sim.executor import SimExecutor, read_model_config

        model_config = read_model_config(model_dir)
        special = {*tokenizer.eos_token_ids, tokenizer.bos_token_id}
        return SimExecutor(
            model_config,
            num_blocks=model_limits.kv_pool_blocks(model_config, config),
            block_size=config.block_size,
            dtype=config.dtype,
            profile=config.sim.profile,
            avoid_token_ids={t for t in special if t is not None},
            time_scale=config.sim.time_scale,
            link_gbps=config.sim.link_gbps,
        )
    from pdserve.engine.model_runner import TorchExecutor

    return TorchExecutor(config, model_dir, tensor_parallel)
