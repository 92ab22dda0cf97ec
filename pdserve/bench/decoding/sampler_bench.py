"""`pdserve bench sampler`: the host's sampling step at a large vocabulary, seeded rows (the
served case: the router gives every request a seed) against unseeded ones, and the seeded draw
in torch against the fused kernel (seeded_draw.py), in the same run on the same logits.

Rows are temperature-only (no filter: every token of the vocabulary is kept and hashed, the
seeded draw's worst case) on random logits times --logit-scale (1: flat, no token is out of the
fused kernel's reach; 8: peaked, most are). Prints the median ms per batch of:
- the whole `sampler.draw` step, unseeded rows (a uniform through the cumulative distribution)
  and seeded rows (as served: the fused draw where the library is built);
- the seeded draw alone (after `kept_tokens`, shared by both): torch path vs fused kernel, and
  whether they drew the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding import sampler, seeded_draw
from pdserve.models import native_attention


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, default=131_072, help="vocabulary (default: 128k)")
    parser.add_argument("--rows", type=int, default=32, help="sampled rows per batch (32)")
    parser.add_argument("--temperature", type=float, default=0.8, help="every row's (0.8)")
    parser.add_argument(
        "--logit-scale", type=float, default=1.0, help="random logits times this (1: flat)"
    )
    parser.add_argument("--repeats", type=int, default=15, help="median of this many (15)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if not native_attention.enabled():
        print("the pdserve_native library is not built here: no fused draw to measure")
        return 1
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=generator) * args.logit_scale
    seeded = [SamplingParams(temperature=args.temperature, seed=i) for i in range(args.rows)]
    unseeded = [SamplingParams(temperature=args.temperature) for _ in range(args.rows)]
    keys = [sampler.noise_key(p, 0) for p in seeded]
    host = torch.Generator().manual_seed(1)

    probs, ids = sampler.kept_tokens(logits, seeded)
    scaled = sampler._with_temperature(logits, seeded)
    key_tensor = torch.tensor(keys, dtype=torch.int64)
    same = torch.equal(
        seeded_draw.gumbel_max_torch(scaled, probs, ids, key_tensor),
        seeded_draw.gumbel_max_fused(scaled, probs, ids, key_tensor),
    )
    # Alternated, so a burst of load on the shared machine hits every variant alike.
    cases: dict[str, Callable[[], object]] = {
        "draw step, unseeded rows": lambda: sampler.draw(logits, unseeded, [host] * args.rows),
        "draw step, seeded rows (served)": lambda: sampler.draw(logits, seeded, keys),
        "seeded draw alone, torch path": lambda: seeded_draw.gumbel_max_torch(
            scaled, probs, ids, key_tensor
        ),
        "seeded draw alone, fused kernel": lambda: seeded_draw.gumbel_max_fused(
            scaled, probs, ids, key_tensor
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            times[name].append(time.perf_counter() - start)
    print(
        f"vocab {args.vocab}, {args.rows} rows, temperature {args.temperature}, logits x "
        f"{args.logit_scale}, {args.threads} threads: median ms per batch of {args.repeats}"
    )
    for name, samples in times.items():
        print(f"  {name:<34} {statistics.median(samples[1:]) * 1e3:8.1f}")
    unseeded_ms = statistics.median(times["draw step, unseeded rows"][1:])
    seeded_ms = statistics.median(times["draw step, seeded rows (served)"][1:])
    torch_ms = statistics.median(times["seeded draw alone, torch path"][1:])
    fused_ms = statistics.median(times["seeded draw alone, fused kernel"][1:])
    print(f"  seeded / unseeded step: {seeded_ms / unseeded_ms:.2f}x")
    print(f"  seeded draw, torch / fused: {torch_ms / fused_ms:.2f}x")
    print(f"  same tokens (torch path, fused kernel): {same}")
    return 0 if same else 1
