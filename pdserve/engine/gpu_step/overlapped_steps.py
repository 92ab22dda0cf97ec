"""OverlappedSteps: the engine's decode steps launched before the step in flight has returned
its tokens (vLLM's async scheduling, SGLang's overlap scheduler). `EngineConfig.async_scheduling`:
on for CUDA. `LLMEngine` (engine.py) owns one and asks it each step whether the next step
overlaps (`overlaps_next`), then launches (`launch`) or lands the step in flight first
(`land_in_flight`).

Without it a GPU idles while the host turns a step's tokens into outputs and schedules and
prepares the next step: 48% of the small model's batch-32 compiled step on an H200, 14% of the
8B shape's (BENCHMARKS.md, "Seventh lease"). With it, a step schedules and launches the next
batch first, then lands the step in flight, whose tokens the device is computing meanwhile:

- Launch: each sequence of the new batch gets a placeholder as its next token, -(its row + 1).
  The placeholders among a batch's input ids are the previous launch's tokens of those rows,
  which the executor puts in place on the device (`TorchExecutor.launch`), so no token crosses
  to the host before the next step is queued.
- Land: the placeholders are taken off again and the step's tokens go through the usual
  `StepOutputs.postprocess` (tokens, stop checks, outputs, prefix caching, KV events), one step
  later than without overlap; sequences of the newer batch get their placeholder back.

A sequence that a landing step finishes (a stop token or string) was already scheduled once
more: that row's token is dropped when its step lands. Its blocks are released at once; the
step still running writes one slot past its end, in a block no one else holds yet, and a later
owner's writes come after it on the device.

Steps overlap only while nothing needs the host first (`overlaps_next`): every running
sequence is a plain decode (`Sequence.overlaps`: greedy, no logprobs, repetition penalty, n,
beams, DoLa/SLED or prefill_only), none waits, no speculation, the token in flight is nobody's
last by length, and there are free blocks for every running sequence's next token, so the
scheduler never preempts (and recomputes) a sequence whose last token is a placeholder.
Otherwise the step in flight lands first and the engine steps as before. The sim executor and
the engine bench's step recorder step one at a time (`Executor.overlaps_steps` false).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step_outputs import StepOutputs

_RUNNING = SequenceStatus.RUNNING


def placeholder(row: int) -> int:
    """The token id standing for the token that row `row` of the launched step samples."""
    return -1 - row


@dataclass
class InFlight:
    """A launched step whose tokens have not landed yet."""

    batch: ScheduledBatch
    launched: Any  # the executor's handle (TorchExecutor.launch)


class OverlappedSteps:
    def __init__(
        self,
        enabled: bool,
        executor: Any,
        scheduler: Scheduler,
        block_manager: BlockManager,
        outputs: StepOutputs,
        max_model_len: int,
    ) -> None:
        """`enabled`: steps may overlap (`LLMEngine.async_scheduling`); `executor`: the engine's
        (`Executor`, executor.py; launches only where `overlaps_steps`); `outputs`: the engine's,
        which a landing step's tokens go through."""
        self.enabled = enabled
        self._executor = executor
        self._scheduler = scheduler
        self._block_manager = block_manager
        self._outputs = outputs
        self._max_model_len = max_model_len
        self.in_flight: InFlight | None = None  # the launched step whose tokens are not back
        self.launched_steps = 0  # steps launched before the previous one's tokens were back

    def overlaps_next(self) -> bool:
        """Whether the next step may be scheduled and launched before the one in flight
        lands: every sequence it would run is a plain decode, nothing else needs the host."""
        if not self.enabled or not getattr(self._executor, "overlaps_steps", False):
            return False
        scheduler = self._scheduler
        running = scheduler.running[: scheduler.max_num_seqs]
        if scheduler.waiting or not running:
            return False
        if self._block_manager.num_free_blocks < len(running):
            return False  # a next token might need a preemption
        max_model_len = self._max_model_len
        for seq in running:
            if not seq.overlaps or seq.num_computed_tokens + 1 != len(seq.token_ids):
                return False
            # Its newest token (in flight or not) is its last by length: no step after it.
            if len(seq.token_ids) >= min(
                seq.num_prompt_tokens + seq.params.max_tokens, max_model_len
            ):
                return False
        return True

    def launch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launches `batch` (`overlaps_next` held when it was scheduled), then lands the step
        that was in flight; returns that step's outputs."""
        previous = self.in_flight
        launched = self._executor.launch(batch, previous.launched if previous else None)
        for row, seq in enumerate(batch.seqs):
            seq.token_ids.append(placeholder(row))
            seq.num_computed_tokens += 1
        self.in_flight = InFlight(batch, launched)
        self.launched_steps += 1
        return self._land(previous) if previous is not None else []

    def land_in_flight(self) -> list[RequestOutput]:
        """Lands the step in flight, with no newer one launched."""
        step, self.in_flight = self.in_flight, None
        return self._land(step) if step is not None else []

    def _land(self, step: InFlight) -> list[RequestOutput]:
        """The tokens of `step` become its sequences' tokens and outputs (`postprocess`); the
        step in flight after it, if any, keeps its placeholders."""
        sample_idx, tokens, logprobs = self._executor.collect(step.launched)
        newer = self.in_flight if self.in_flight is not step else None
        row_in_newer = {id(s): row for row, s in enumerate(newer.batch.seqs)} if newer else {}
        live = ScheduledBatch()
        landed: list[tuple[int, int, float | None]] = []
        for i, token, logprob in zip(sample_idx, tokens, logprobs, strict=True):
            seq: Sequence = step.batch.seqs[i]
            if seq.status is not _RUNNING:
                continue  # finished (a stop, or aborted) since it was launched: dropped
            # Back to the state the step was launched from: its placeholder (and the newer
            # step's) off, its computed position not yet counted.
            taken = 2 if id(seq) in row_in_newer else 1
            del seq.token_ids[-taken:]
            seq.num_computed_tokens -= taken
            landed.append((len(live.seqs), token, logprob))
            live.add(seq, 1)
        outputs = self._outputs.postprocess(
            live, [i for i, _, _ in landed], [t for _, t, _ in landed], [p for _, _, p in landed]
        )
        for seq in live.seqs:
            row = row_in_newer.get(id(seq))
            if row is not None and seq.status is _RUNNING:
                seq.token_ids.append(placeholder(row))
                seq.num_computed_tokens += 1
        return outputs
