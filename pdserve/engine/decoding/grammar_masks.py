"""GrammarMasks: a step's token bitmasks, filled while the forward pass runs.

`TorchExecutor.execute` starts the fill before the forward (`start`) and applies the masks
to the logits after it (`apply`), as xgrammar's vLLM and SGLang integrations do: the torch ops
of the forward release the GIL, so a worker thread fills the rows meanwhile, and the step pays
only for applying them. What is ours to keep small:
- one int32 bitmask [rows, ceil(vocab / 32)] kept across steps (grown when a step has more
  rows), not one allocated per step;
- the plain rows filled by xgrammar's BatchGrammarMatcher in one call (its own threads);
- rows of unconstrained sequences neither filled nor applied (`indices`).

A speculating sequence's d drafts have d + 1 rows: row j is masked by the grammar's state
after the first j drafts (the matcher is advanced through them and rolled back), so each
verified position samples among the tokens the grammar allows there (`speculative_step.py`
has already cut the drafts at the first token the grammar refuses).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MaskRows:
    """One constrained sequence's rows of the step's logits: `rows[j]` is masked by its grammar
    after `drafts[:j]` (no drafts: one row, the grammar's current state)."""

    matcher: Any  # xgrammar.GrammarMatcher
    rows: tuple[int, ...]
    drafts: tuple[int, ...] = ()


class GrammarMasks:
    """An executor's bitmask buffer and the worker thread that fills it."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size  # the logits' width
        self._bitmask: Any = None  # int32 [capacity, ceil(vocab / 32)], on the host
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher
        self._worker: ThreadPoolExecutor | None = None  # made on the first constrained step

    def start(self, sequences: Sequence[MaskRows], num_rows: int) -> Future | None:
        """Starts filling the masks of a step with `num_rows` logits rows; None when no
        sequence is constrained. The matchers must not change until `apply` returns."""
        if not sequences:
            return None
        if self._worker is None:
            import xgrammar

            self._batch = xgrammar.BatchGrammarMatcher()
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        bitmask = self._buffer(num_rows)
        return self._worker.submit(self._fill, list(sequences), bitmask)

    def apply(self, pending: Future | None, logits: Any) -> None:
        """Waits for the fill `start` began and sets, in place, the logits of every token
        outside a constrained row's grammar to -inf. logits: [num_rows, vocab]."""
        if pending is None:
            return
        import xgrammar

        bitmask, rows = pending.result()
        xgrammar.apply_token_bitmask_inplace(
            logits, bitmask[: logits.shape[0]].to(logits.device), indices=rows
        )

    def _buffer(self, num_rows: int) -> Any:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar

            self._bitmask = xgrammar.allocate_token_bitmask(num_rows, self._vocab_size)
        return self._bitmask

    def _fill(self, sequences: list[MaskRows], bitmask: Any) -> tuple[Any, list[int]]:
        plain = [s for s in sequences if not s.drafts]
        if plain:
            self._batch.batch_fill_next_token_bitmask(
                [s.matcher for s in plain], bitmask, [s.rows[0] for s in plain]
            )
        for s in sequences:
            if s.drafts:
                _fill_drafted(s, bitmask)
        return bitmask, [row for s in sequences for row in s.rows]


def _fill_drafted(sequence: MaskRows, bitmask: Any) -> None:
    """Row j = the grammar after drafts[:j]; the matcher ends where it started."""
    matcher, accepted = sequence.matcher, 0
    for row, draft in zip(sequence.rows, sequence.drafts, strict=False):
        matcher.fill_next_token_bitmask(bitmask, row)
        if not matcher.accept_token(draft):
            raise AssertionError("a draft the grammar refuses reached verification")
        accepted += 1
    matcher.fill_next_token_bitmask(bitmask, sequence.rows[-1])
    matcher.rollback(accepted)
