"""OverlappedSteps: the steps of `LLMEngine` (engine.py, which inherits them) that schedule and
launch the next decode step before the step in flight has returned its tokens (vLLM's async
scheduling, SGLang's overlap scheduler). `EngineConfig.async_scheduling`: on for CUDA.

Without it a GPU idles while the host turns a step's tokens into outputs and schedules and
prepares the next step: 48% of the small model's batch-32 compiled step on an H200, 14% of the
8B shape's (BENCHMARKS.md, "Seventh lease"). With it, a step schedules and launches the next
batch first, then lands the step in flight, whose tokens the device is computing meanwhile:

- Launch: each sequence of the new batch gets a placeholder as its next token, -(its row + 1).
  The placeholders among a batch's input ids are the previous launch's tokens of those rows,
  which the executor puts in place on the device (`TorchExecutor.launch`), so no token crosses
  to the host before the next step is queued.
- Land: the placeholders are taken off again and the step's tokens go through the usual
  `_postprocess` (tokens, stop checks, outputs, prefix caching, KV events), one step later than
  without overlap; sequences of the newer batch get their placeholder back.

A sequence that a landing step finishes (a stop token or string) was already scheduled once
more: that row's token is dropped when its step lands. Its blocks are released at once; the
step still running writes one slot past its end, in a block no one else holds yet, and a later
owner's writes come after it on the device.

Steps overlap only while nothing needs the host first (`_overlaps_next`): every running
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

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence, SequenceStatus

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
    def _overlaps_next(self) -> bool:
        """Whether the next step may be scheduled and launched before the one in flight
        lands: every sequence it would run is a plain decode, nothing else needs the host."""
        if not self.async_scheduling or not getattr(self.executor, "overlaps_steps", False):
            return False
        scheduler = self.scheduler
        running = scheduler.running[: scheduler.max_num_seqs]
        if scheduler.waiting or not running:
            return False
        if self.block_manager.num_free_blocks < len(running):
            return False  # a next token might need a preemption
        max_model_len = self.max_model_len
        for seq in running:
            if not seq.overlaps or seq.num_computed_tokens + 1 != len(seq.token_ids):
                return False
            # Its newest token (in flight or not) is its last by length: no step after it.
            if len(seq.token_ids) >= min(
                seq.num_prompt_tokens + seq.params.max_tokens, max_model_len
            ):
                return False
        return True

    def _launch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launches `batch` (`_overlaps_next` held when it was scheduled), then lands the step
        that was in flight; returns that step's outputs."""
        previous = self._in_flight
        launched = self.executor.launch(batch, previous.launched if previous else None)
        for row, seq in enumerate(batch.seqs):
            seq.token_ids.append(placeholder(row))
            seq.num_computed_tokens += 1
        self._in_flight = InFlight(batch, launched)
        return self._land(previous) if previous is not None else []

    def _land_in_flight(self) -> list[RequestOutput]:
        """Lands the step in flight, with no newer one launched."""
        step, self._in_flight = self._in_flight, None
        return self._land(step) if step is not None else []

    def _land(self, step: InFlight) -> list[RequestOutput]:
        """The tokens of `step` become its sequences' tokens and outputs (`_postprocess`); the
        step in flight after it, if any, keeps its placeholders."""
        sample_idx, tokens, logprobs = self.executor.collect(step.launched)
        newer = self._in_flight if self._in_flight is not step else None
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
        outputs = self._postprocess(
            live, [i for i, _, _ in landed], [t for _, t, _ in landed], [p for _, _, p in landed]
        )
        for seq in live.seqs:
            row = row_in_newer.get(id(seq))
            if row is not None and seq.status is _RUNNING:
                seq.token_ids.append(placeholder(row))
                seq.num_computed_tokens += 1
        return outputs
