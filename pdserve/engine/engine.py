"""LLMEngine: one engine for every role (colocated, prefill, decode).

A step reads: schedule -> run -> postprocess. Besides plain generation it has the hooks of
disaggregated serving (docs/structures.md, "Engine"): a prefill_only request keeps its blocks
*held* after its first token until `release()`; the decode side `reserve()`s a block table,
receives KV with `write_kv()` (from another thread) and `commit()`s to join the batch.
All methods except `write_kv` and `read_kv` must be called from one thread.

What runs the model sits behind one seam, the `Executor`: `TorchExecutor` (model_runner.py:
the model, the KV cache tensor, the sampler) or, with `EngineConfig.kind == "sim"`,
`pdserve.sim.executor.SimExecutor` (a timing model and deterministic tokens, no torch). The
scheduler, block manager, sequences and prefix cache are the same for both, and this module
imports torch only through the torch executor.

The engine is composed of parts, each with its own state, all made in `__init__`: the block
manager and the scheduler; `forks` (`ForkedChoices`, decoding/forked_choices.py), which runs
requests with n > 1 and beam search as forked sequences sharing KV blocks; `step_outputs`
(`StepOutputs`, step_outputs.py), which turns a step's sampled tokens into sequences' tokens and
outputs; `overlapped_steps` (`OverlappedSteps`, gpu_step/overlapped_steps.py), which with
`async_scheduling` launches plain decode steps before the previous one's tokens are back, to land
one step later; and speculative decoding (`Speculation`, speculation/speculative_step.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from pdserve.core import model_limits
from pdserve.core.kv_events import KVEvent, KVEventSink
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.decoding.forked_choices import ForkedChoices
from pdserve.engine.decoding.grammar import Grammars
from pdserve.engine.executor import Executor, make_executor
from pdserve.engine.gpu_step.overlapped_steps import OverlappedSteps
from pdserve.engine.host_tier import HostTier, host_tier_stats
from pdserve.engine.outputs import RequestOutput, Reservation
from pdserve.engine.peer_prefixes import PeerPrefixes
from pdserve.engine.request_admission import RequestAdmission
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculation.speculative_step import make_speculation, speculation_stats
from pdserve.engine.step_outputs import StepOutputs
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import default_model_dir
from pdserve.tokenizer import Tokenizer

__all__ = ["Executor", "LLMEngine", "RequestOutput", "Reservation", "SamplingParams", "KVEvent"]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        kv_event_sink: KVEventSink | None = None,
        executor: Executor | None = None,
        emit_text: bool = True,
        tokenizer: Tokenizer | None = None,
        tensor_parallel: Any = None,
    ) -> None:
        """`emit_text=False`: outputs carry no text (`text_delta` stays empty) and only requests
        with stop strings are detokenized, to find them — for workers whose router decodes the
        client's text itself. `tokenizer`: the model directory's, already loaded (engines of
        one process may share it; loading a large vocabulary takes about a second).
        `tensor_parallel`: this process's rank (models.tensor_parallel.TensorParallel) of the
        config.tp ranks that run the model together; each rank's engine must see the same
        requests in the same order."""
        model_dir = Path(config.model) if config.model else default_model_dir()
        self.config = config
        self.emit_text = emit_text
        try:
            self.tokenizer = tokenizer or Tokenizer.from_dir(model_dir)
        except FileNotFoundError as e:
            from pdserve.models.hf_config import ModelLoadError

            raise ModelLoadError(str(e)) from e
        self.executor = executor or make_executor(
            config, model_dir, self.tokenizer, tensor_parallel
        )
        self.model_config = self.executor.model_config
        self.kv_cache = self.executor.kv_cache
        self.block_size = config.block_size
        self.num_layers = self.executor.num_layers
        self.max_model_len = model_limits.max_model_len(self.model_config, config)
        num_blocks = model_limits.kv_pool_blocks(self.model_config, config)
        self.host_tier = self._host_tier(config)
        self.block_manager = BlockManager(
            num_blocks, self.block_size, config.enable_prefix_caching, self.host_tier
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
        )
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.grammars = Grammars(model_dir, self.executor.vocab_size, self.tokenizer.eos_token_ids)
        self._speculation = make_speculation(config, self.block_manager, self.max_model_len)
        self._kv_event_sink = kv_event_sink
        self._seqs: dict[str, Sequence] = {}  # by request id: choice 0's sequence
        self._pending: list[RequestOutput] = []  # outputs produced outside step()
        self._arrivals = itertools.count()  # numbers sequences in arrival order
        self.admission = RequestAdmission(
            config,
            self.executor,
            self.tokenizer,
            self.grammars,
            self._arrivals,
            self.max_model_len,
            emit_text,
        )
        self._steps = 0
        self.forks = ForkedChoices(
            self._seqs,
            self.scheduler,
            self.block_manager,
            self._finish,
            self.admission.detokenizer,
            self._arrivals,
            self.eos_token_ids,
            self.max_model_len,
        )
        self.step_outputs = StepOutputs(
            self.scheduler,
            self.block_manager,
            self.forks,
            self._speculation,
            self._finish,
            self.eos_token_ids,
            self.max_model_len,
        )
        # Peer pulls (docs/design.md): prefixes pinned for a peer, pulled prefixes committed.
        self.peer_prefixes = PeerPrefixes(
            self._seqs, self.scheduler, self.block_manager, self.forks, self._fence_host_copies
        )
        # Plain decode steps launched before the previous one's tokens are back; not with
        # speculation, whose drafts need the last token.
        overlap = config.async_scheduling
        if overlap is None:
            overlap = config.device.startswith("cuda")
        self.overlapped_steps = OverlappedSteps(
            overlap and self._speculation is None,
            self.executor,
            self.scheduler,
            self.block_manager,
            self.step_outputs,
            self.max_model_len,
        )

    @property
    def model(self) -> Any:
        """The torch model (torch executor only)."""
        return self.executor.model

    @property
    def runner(self) -> Any:
        """The ModelRunner (torch executor only)."""
        return self.executor.runner

    @property
    def async_scheduling(self) -> bool:
        """Whether plain decode steps may overlap (gpu_step/overlapped_steps.py); settable."""
        return self.overlapped_steps.enabled

    @async_scheduling.setter
    def async_scheduling(self, enabled: bool) -> None:
        self.overlapped_steps.enabled = enabled

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block over all layers (what a transfer moves per block)."""
        return self.executor.bytes_per_block

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
    ) -> None:
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only)
        if prefill_only:  # a prefill worker computes the prompt (and choice 0's first token)
            pass
        elif params.beam_search:
            self.forks.start_beams(seq)
        elif params.n > 1:
            seq.pending_forks = list(range(1, params.n))
        self._seqs[request_id] = seq
        self.forks.track(request_id, params)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks at once, whatever its state. Unknown ids are ignored."""
        seq = self._seqs.pop(request_id, None)
        self.forks.abort(request_id)
        if seq is not None:
            self._finish(seq, "abort")
            self._emit_events()

    def release(self, request_id: str) -> None:
        """Frees the blocks of a held prefill_only request (no-op for other states)."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.status == SequenceStatus.HELD:
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether step() has work (waiting or running requests, a step in flight, or outputs to
        deliver)."""
        return (
            self.scheduler.has_work()
            or bool(self._pending)
            or self.overlapped_steps.in_flight is not None
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Convenience for tests and benchmarks: runs prompts to completion, returns outputs."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(rid, prompt, p)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
        return [tokens[rid] for rid in ids]

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess. An overlapped step's run is a launch, and what it
        postprocesses is the step launched before it, landing now."""
        started = time.perf_counter()
        batch, overlap, outputs = self._schedule()
        if batch.seqs and overlap:
            outputs += self.overlapped_steps.launch(batch)
        elif batch.seqs:
            outputs += self.step_outputs.postprocess(batch, *self.executor.execute(batch, started))
        self._end_step()
        return outputs

    def _schedule(self) -> tuple[ScheduledBatch, bool, list[RequestOutput]]:
        """The step's batch, whether it overlaps the step in flight, and the outputs already
        due: those produced outside step(), and the step in flight's when it lands first."""
        outputs, self._pending = self._pending, []
        overlap = self.overlapped_steps.overlaps_next()
        if not overlap:  # the next batch needs every token: the step in flight lands first
            outputs += self.overlapped_steps.land_in_flight()
        spec = self._speculation
        drafted = spec.propose(self.scheduler.running) if spec else []
        batch = self.scheduler.schedule()
        if spec:
            spec.fit(drafted, batch)
        self._fence_host_copies()
        if batch.seqs:
            self.forks.fork_pending(batch)
            if batch.block_copies:
                self.executor.copy_blocks(batch.block_copies)
                if spec:
                    spec.copy_blocks(batch.block_copies)
        return batch, overlap, outputs

    def _end_step(self) -> None:
        if self._speculation is not None:
            self._speculation.end_step()
        self._steps += 1
        self._emit_events()

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self._speculation is not None:
            self._speculation.forget(seq)
        self.scheduler.remove(seq)
        self.block_manager.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- decode-side handoff ------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        pull: bool = False,
    ) -> Reservation | None:
        """Allocates the prompt's whole block table, reusing prefix-cache hits; None when
        there is no room now. Blocks from `missing_block_indices` on must be written. A `pull`
        (of a prefix from a peer) ends in `commit_prefix` or `fall_back`, which prefill at
        least the last prompt token here, so its hits stop before that token."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only=False)
        reusable = seq.num_tokens - 1 if pull else seq.num_tokens
        cached = self.block_manager.acquire_prefix(seq, reusable)
        if not self.block_manager.ensure_blocks(seq, seq.num_tokens):
            self.block_manager.release(seq)
            self._emit_events()
            return None
        self._fence_host_copies()  # before the transfer writes the blocks (another thread)
        seq.status = SequenceStatus.RESERVED
        seq.admitted = True
        seq.num_cached_tokens = cached
        self.scheduler.prefix_hit_tokens += cached
        self.scheduler.prefix_host_hit_tokens += seq.num_host_hit_tokens
        self.scheduler.prefix_disk_hit_tokens += seq.num_disk_hit_tokens
        self.scheduler.prefix_query_tokens += seq.num_prompt_tokens
        self._seqs[request_id] = seq
        self.forks.track(request_id, params)
        self.peer_prefixes.pulls_started += pull
        self._emit_events()
        missing = list(range(cached // self.block_size, len(seq.block_table)))
        return Reservation(cached, list(seq.block_table), missing)

    def write_kv(
        self, block_ids: list[int], layer_start: int, data: Any, head_start: int = 0
    ) -> None:
        """data: [l1 - l0, 2, n, block_size, h, head_dim] -> kv_cache[l0:l1, :, ids]'s heads
        [head_start, head_start + h) (on a tensor-parallel worker: rank 0's own cache).
        Thread-safe against step(): reserved blocks are never read or written by a step."""
        self.executor.write_kv(block_ids, layer_start, data, head_start)

    def read_kv(self, block_ids: list[int], layer_start: int, layer_end: int) -> Any:
        """A contiguous copy of kv_cache[l0:l1, :, block_ids] (sim: its shape, no bytes; on a
        tensor-parallel worker: rank 0's own heads)."""
        return self.executor.read_kv(block_ids, layer_start, layer_end)

    def commit(
        self,
        request_id: str,
        first_token_id: int,
        first_logprob: float | None,
        *,
        cache_blocks: bool = True,
    ) -> None:
        """The reserved prompt's KV is complete: cache its full blocks (unless `cache_blocks`
        is False: KV from an untrusted peer then serves only this request), append the first
        token (whose text the prefill side already emitted) and join the running batch.
        Raises ValueError for a first token outside the vocabulary, changing nothing."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.RESERVED:
            raise KeyError(f"request {request_id!r} has no reservation to commit")
        vocab = self.executor.vocab_size
        if not 0 <= first_token_id < vocab:
            raise ValueError(
                f"first_token_id {first_token_id} is outside the vocabulary [0, {vocab})"
            )
        seq.cache_blocks = cache_blocks
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_full_blocks(seq)
        if seq.params.beam_search:  # the search needs the last prompt position's candidates
            seq.num_computed_tokens = seq.num_prompt_tokens - 1
            self.forks.start_beams(seq)
            self.scheduler.add_running(seq)
            self._emit_events()
            return
        if seq.params.n > 1:  # choice 1 recomputes the last prompt position, then forks
            second = self.forks.fork(seq, 1)
            second.num_computed_tokens = seq.num_prompt_tokens - 1
            second.pending_forks = list(range(2, seq.params.n))
        out = self.step_outputs.append_tokens(seq, [first_token_id], [first_logprob])
        if out.finished:  # the first token already ended it; report the end, not the token
            self._pending.append(
                RequestOutput(
                    request_id,
                    finished=True,
                    finish_reason=out.finish_reason,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_tokens,
                    open_choices=out.open_choices,
                )
            )
        else:
            self.scheduler.add_running(seq)
        self._emit_events()

    def commit_prefix(self, request_id: str, pulled_blocks: int, cache_blocks: bool) -> None:
        """A pull's blocks up to `pulled_blocks` arrived: the rest of the prompt is prefilled
        here (PeerPrefixes.commit_prefix)."""
        self.peer_prefixes.commit_prefix(request_id, pulled_blocks, cache_blocks)
        self._emit_events()

    def fall_back(self, request_id: str) -> bool:
        """A pull ended without its blocks: the prompt is prefilled from this worker's own
        hits. False when the request is no longer reserved."""
        return self.peer_prefixes.fall_back(request_id)

    def pin_prefix(self, push_id: str, token_ids: Seq[int]) -> list[int] | None:
        """The cached blocks of `token_ids`' full blocks, held until `unpin_prefix`; None
        unless every one is cached (PeerPrefixes.pin)."""
        block_ids = self.peer_prefixes.pin(push_id, token_ids)
        self._emit_events()
        return block_ids

    def unpin_prefix(self, push_id: str) -> None:
        self.peer_prefixes.unpin(push_id)
        self._emit_events()

    def close(self) -> None:
        """Stops the engine's background work (the disk tier's writer); called once its thread
        has stopped stepping."""
        if self.host_tier is not None:
            self.host_tier.close()

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        bm, sched = self.block_manager, self.scheduler
        by_status = {s: 0 for s in SequenceStatus}
        for seq in self._seqs.values():
            by_status[seq.status] += 1
        return {
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_used_blocks": bm.num_used_blocks,
            "num_cached_blocks": bm.num_cached_blocks,
            "num_waiting": len(sched.waiting),
            "num_running": len(sched.running),
            "num_reserved": by_status[SequenceStatus.RESERVED],
            "num_held": by_status[SequenceStatus.HELD],
            "waiting_prompt_tokens": sum(s.num_uncomputed_tokens for s in sched.waiting),
            "prefix_hit_tokens": sched.prefix_hit_tokens,
            "prefix_query_tokens": sched.prefix_query_tokens,
            "prefix_host_hit_tokens": sched.prefix_host_hit_tokens,
            "prefix_disk_hit_tokens": sched.prefix_disk_hit_tokens,
            "prefix_peer_hit_tokens": self.peer_prefixes.peer_hit_tokens,
            "peer_pulls_started": self.peer_prefixes.pulls_started,
            "peer_pulls_committed": self.peer_prefixes.pulls_committed,
            "peer_pulls_fallen_back": self.peer_prefixes.pulls_fallen_back,
            **host_tier_stats(self.host_tier),
            "num_preemptions": sched.num_preemptions,
            "prefill_tokens_computed": self.step_outputs.prefill_tokens_computed,
            "decode_tokens": self.step_outputs.decode_tokens,
            "steps": self._steps,
            "overlapped_steps": self.overlapped_steps.launched_steps,
            **speculation_stats(self._speculation),
            **self.executor.stats(),
        }

    # ---- helpers ------------------------------------------------------------------------
    def _host_tier(self, config: EngineConfig) -> HostTier | None:
        """The host tier of --kv-offload-gb over the disk tier of --kv-disk-dir (None when off
        or too small for one block)."""
        if not config.kv_offload_gb or not config.enable_prefix_caching:
            return None
        if config.kind == "sim":
            from pdserve.engine.sim_host_tier import make_sim_host_tier

            return make_sim_host_tier(self.executor, config)
        if config.kind != "torch":
            raise ValueError("kv_offload_gb: needs the torch engine")
        if config.tp > 1:  # every rank copies its heads (tp_executor.py); no disk tier yet
            if config.kv_disk_gb:
                raise ValueError("kv_disk_gb: not supported yet under tensor parallelism")
            return self.executor.host_tier(int(config.kv_offload_gb * 2**30))
        from pdserve.engine.host_kv_pool import make_host_tier

        return make_host_tier(
            self.kv_cache,
            int(config.kv_offload_gb * 2**30),
            config.kv_disk_dir,
            int(config.kv_disk_gb * 2**30),
        )

    def _fence_host_copies(self) -> None:
        """Device work queued from here on waits for the host tier's copies (host_kv_pool.py)."""
        if self.host_tier is not None:
            self.host_tier.copier.fence()

    def _new_sequence(
        self, request_id: str, prompt: Seq[int], params: SamplingParams, prefill_only: bool
    ) -> Sequence:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.admission.new_sequence(request_id, prompt, params, prefill_only)

    def _emit_events(self) -> None:
        events = self.block_manager.take_events()
        if events and self._kv_event_sink is not None:
            self._kv_event_sink(events)
