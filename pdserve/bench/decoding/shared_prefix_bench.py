"""Where shared-prefix attention pays: per-step attention time (every layer + the step's
context build) of 8 requests x 4 beams, each request's beams attending as one family vs each
beam over its own table, by shared prompt blocks (the bound in gpu_step/attention_batch.py).

    python -m pdserve.bench.decoding.shared_prefix_bench [--threads 1]

Prints plain/shared time per case (> 1: sharing pays). Heads and layers of the `small` preset.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.engine.gpu_step import attention_batch
from pdserve.models.attention import paged_attention

BLOCK, KV_HEADS, HEADS, HEAD_DIM, LAYERS, POOL = 16, 4, 8, 64, 8, 3000


def beam_step(prompt: int, generated: int, requests: int = 8, beams: int = 4):
    """A decode step of `requests` x `beams` forks: starts, lens, tables, slots."""
    free = list(range(1, POOL))
    starts, tables, slots = [], [], []
    for _ in range(requests):
        shared = [free.pop() for _ in range(prompt // BLOCK)]
        for b in range(beams):
            length = prompt + generated + b % 2
            table = shared + [free.pop() for _ in range(-(-length // BLOCK) - len(shared))]
            tables.append(table)
            starts.append(length - 1)
            slots.append(table[(length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK)
    return starts, [1] * len(starts), tables, slots


def step_seconds(step, cache, share: bool) -> float:
    """One step with families forced on (any shared block) or off."""
    saved = attention_batch.MIN_SHARED_BLOCKS, attention_batch.SHARED_TO_OWN_BLOCKS
    attention_batch.MIN_SHARED_BLOCKS = 1 if share else 1 << 30
    attention_batch.SHARED_TO_OWN_BLOCKS = 0
    try:
        rows = len(step[0])
        q = torch.randn(rows, HEADS, HEAD_DIM)
        k, v = torch.randn(rows, KV_HEADS, HEAD_DIM), torch.randn(rows, KV_HEADS, HEAD_DIM)
        start = time.perf_counter()
        ctx = attention_batch.attention_context(*step, BLOCK, torch.device("cpu"))
        for _ in range(LAYERS):
            paged_attention(q, k, v, cache, ctx)
        return time.perf_counter() - start
    finally:
        attention_batch.MIN_SHARED_BLOCKS, attention_batch.SHARED_TO_OWN_BLOCKS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache = torch.randn(2, POOL, BLOCK, KV_HEADS, HEAD_DIM)
    print(f"{'shared blocks':>13} {'generated':>9} {'plain ms':>9} {'shared ms':>9} {'ratio':>6}")
    for shared_blocks in (1, 2, 3, 4, 8, 32):
        for generated in (4, 20):
            step = beam_step(shared_blocks * BLOCK + 5, generated)
            plain, shared = [], []
            for _ in range(args.repeats + 1):  # alternating, the first pair a warm-up
                plain.append(step_seconds(step, cache, share=False))
                shared.append(step_seconds(step, cache, share=True))
            p = sorted(plain[1:])[args.repeats // 2]
            s = sorted(shared[1:])[args.repeats // 2]
            print(
                f"{shared_blocks:>13} {generated:>9} {p * 1e3:>9.2f} {s * 1e3:>9.2f} {p / s:>5.2f}x"
            )


if __name__ == "__main__":
    main()
