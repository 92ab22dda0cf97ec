"""The grammar's own work in one decode step of `pdserve bench engine --decoding json`, timed
alone (min and median of 300): 32 rows of small-llama (8192 tokens) under the bench's schema,
each walked 40 tokens into it. "before": what the engine thread did until the masks were
filled during the forward (a bitmask allocated, every row filled by its own call, applied);
"engine thread": what it does now (the apply); "worker thread": the batched fill that now
runs while the forward does; "accept": advancing the 32 matchers by one token each.

    python docs/scripts/grammar_step_cost.py

A one-off diagnostic, not a benchmark: it found where the grammar's step cost lay when the
mask fill moved into the forward, and "before" replays code the engine no longer
has, so there is nothing for a user to rerun against. The figures it produced stay in
docs/decoding.md and docs/benchmarks/decoding.md; `pdserve bench engine --decoding json` is the
benchmark of structured output's cost.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xgrammar

from pdserve.bench.engine.engine_bench import JSON_RECORDS
from pdserve.engine.decoding.grammar import Grammars
from pdserve.models.builtin import builtin_model_dir

ROWS = 32
RUNS = 300


def timed(work: Callable[[], object]) -> str:
    work()
    seconds = []
    for _ in range(RUNS):
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return f"min {min(seconds) * 1e3:.3f} ms, median {statistics.median(seconds) * 1e3:.3f} ms"


def main() -> None:
    torch.set_num_threads(2)
    model_dir = Path(builtin_model_dir("small"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    grammars = Grammars(model_dir, vocab, eos_token_ids=[2])
    matchers = [grammars.start(JSON_RECORDS).matcher for _ in range(ROWS)]
    rows = list(range(ROWS))
    bitmask = xgrammar.allocate_token_bitmask(ROWS, vocab)
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):  # each row's argmax of random logits under its mask
        logits = torch.randn(ROWS, vocab, generator=generator)
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        for matcher, token in zip(matchers, logits.argmax(-1).tolist(), strict=True):
            matcher.accept_token(token)
    logits = torch.randn(ROWS, vocab, generator=generator)
    batch = xgrammar.BatchGrammarMatcher()

    def before() -> None:
        fresh = xgrammar.allocate_token_bitmask(ROWS, vocab)
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(fresh, row)
        xgrammar.apply_token_bitmask_inplace(logits, fresh, indices=rows)

    batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
    tokens = logits.clone()
    xgrammar.apply_token_bitmask_inplace(tokens, bitmask)
    next_tokens = tokens.argmax(-1).tolist()

    def accept() -> None:
        for matcher, token in zip(matchers, next_tokens, strict=True):
            matcher.accept_token(token)
        for matcher in matchers:
            matcher.rollback(1)

    def apply() -> None:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)

    def fill() -> None:
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    print(f"before, engine thread (allocate, fill row by row, apply): {timed(before)}")
    print(f"now, engine thread (apply): {timed(apply)}")
    print(f"now, worker thread during the forward (batched fill): {timed(fill)}")
    print(f"accept one token per row (and roll it back): {timed(accept)}")


if __name__ == "__main__":
    main()
