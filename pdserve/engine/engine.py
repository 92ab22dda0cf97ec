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
one step later; speculative decoding (`Speculation`, speculation/speculative_step.py);
`admission` (`RequestAdmission`, request_admission.py), which checks a request and makes its
first sequence; `handoff` (`KVHandoff`, kv_handoff.py), the decode side's reserve and commit;
`peer_prefixes` (`PeerPrefixes`, peer_prefixes.py), a peer pull's pins and commits; and the
host tier its config asks for (host_tier_config.py). The engine's methods of the handoff and
of peer pulls delegate to their part and emit the KV events; `stats()` is engine_stats.py's.
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
from pdserve.engine.engine_stats import engine_stats
from pdserve.engine.executor import Executor, make_executor
from pdserve.engine.gpu_step.overlapped_steps import OverlappedSteps
from pdserve.engine.host_tier_config import host_tier_from_config
from pdserve.engine.kv_handoff import KVHandoff
from pdserve.engine.outputs import RequestOutput, Reservation
from pdserve.engine.peer_prefixes import PeerPrefixes
from pdserve.engine.request_admission import RequestAdmission
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculation.speculative_step import make_speculation
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
        self.host_tier = host_tier_from_config(config, self.executor)
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
        # The decode side of a handoff: a reserved block table, then a commit (kv_handoff.py).
        self.handoff = KVHandoff(
            self._seqs,
            self._new_sequence,
            self.executor,
            self.scheduler,
            self.block_manager,
            self.forks,
            self.step_outputs,
            self.peer_prefixes,
            self._fence_host_copies,
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

    # ---- decode-side handoff (kv_handoff.py) and peer pulls (peer_prefixes.py) ------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        pull: bool = False,
    ) -> Reservation | None:
        """The prompt's whole block table, for KV written from elsewhere; None when there is
        no room now (KVHandoff.reserve)."""
        reservation = self.handoff.reserve(request_id, prompt_token_ids, params, pull)
        self._emit_events()
        return reservation

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
        """The reserved prompt's KV is complete: it joins the running batch with its first
        token (KVHandoff.commit: KeyError, ValueError change nothing)."""
        ended = self.handoff.commit(request_id, first_token_id, first_logprob, cache_blocks)
        if ended is not None:
            self._pending.append(ended)
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
        """Every part's counters and gauges (engine_stats.py; docs/structures.md lists them)."""
        return engine_stats(self, self._seqs.values(), self._steps, self._speculation)

    # ---- helpers ------------------------------------------------------------------------
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
