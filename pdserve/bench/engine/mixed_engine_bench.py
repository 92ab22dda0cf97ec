"""`pdserve bench engine-mixed`: requests/s of the engine's continuous batching vs transformers'
`generate` in static batches, over the same mixed-length requests (issue 19 point 2).

Workload: `--requests` requests (64 by default) whose prompt and output lengths are log-normal
with the means of ShareGPT as the vLLM paper reports them (Kwon et al., SOSP 2023, Fig. 11:
161.31 input and 337.99 output tokens on average), times `--length-scale` so a CPU run stays
short, and `--sigma` (the spread of the logarithm; 1.0 gives ShareGPT's heavy tail, a few
requests many times the median). Drawn from `--seed`, so every run measures the same requests.

Both engines: the same weights and dtype, greedy, EOS ignored, each request exactly its own
number of new tokens, at most `--batch-size` sequences at once. pdserve takes every request at
once and its scheduler keeps up to batch-size running, a finished one's place taken by the next
at the following step. transformers takes them in arrival order, batch-size at a time,
left-padded, each batch running `generate` to its longest request's output length (a static
batch ends when its longest sequence does; the extra tokens of shorter ones are discarded, so
only each request's own tokens count). Requests/s is requests over the seconds from the first
request to the last result; output tokens/s counts each request's own tokens.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import numpy as np

from pdserve.models.presets import WEIGHT_PRESETS

# ShareGPT's mean prompt and output lengths in tokens (vLLM paper, Fig. 11).
SHAREGPT_MEAN_INPUT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99


@dataclass(frozen=True)
class MixedRequest:
    prompt: list[int]
    output_len: int


def lognormal_lengths(
    rng: np.random.Generator, mean: float, sigma: float, n: int, longest: int
) -> list[int]:
    """n lengths, log-normal with this mean (median = mean / exp(sigma^2 / 2)), in [2, longest]."""
    median = mean / math.exp(sigma * sigma / 2)
    values = median * np.exp(sigma * rng.standard_normal(n))
    return [int(v) for v in np.clip(np.rint(values), 2, longest)]


def mixed_requests(
    n: int, vocab_size: int, scale: float, sigma: float, longest: int, seed: int
) -> list[MixedRequest]:
    """The seeded workload: ShareGPT-like lengths times `scale`, random prompt tokens (ids >= 3,
    clear of the special tokens)."""
    rng = np.random.default_rng(seed)
    prompt_lens = lognormal_lengths(rng, SHAREGPT_MEAN_INPUT * scale, sigma, n, longest)
    output_lens = lognormal_lengths(rng, SHAREGPT_MEAN_OUTPUT * scale, sigma, n, longest)
    return [
        MixedRequest(rng.integers(3, vocab_size, p).tolist(), o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", choices=WEIGHT_PRESETS, default="small", help="built-in model (small)"
    )
    parser.add_argument("--model", default=None, help="a model directory instead of a preset")
    parser.add_argument("--requests", type=int, default=64, help="requests (default: 64)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="most sequences at once, in both engines (default: 16)",
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        default=0.25,
        help="ShareGPT's mean lengths are multiplied by this (default: 0.25)",
    )
    parser.add_argument(
        "--sigma", type=float, default=1.0, help="spread of the log of lengths (default: 1.0)"
    )
    parser.add_argument(
        "--max-len", type=int, default=512, help="longest prompt or output (default: 512)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="(default: float32)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's default)"
    )


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig
    from pdserve.models.builtin import builtin_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.requests < 1 or args.batch_size < 1 or args.length_scale <= 0 or args.max_len < 2:
        raise SystemExit("--requests, --batch-size, --length-scale and --max-len must be positive")
    model_dir = args.model or str(builtin_model_dir(args.preset))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype)
    )
    hf = hf.to(args.device).eval()
    vocab = hf.config.vocab_size
    requests = mixed_requests(
        args.requests, vocab, args.length_scale, args.sigma, args.max_len, args.seed
    )
    block_size = 16
    longest = max(len(r.prompt) + r.output_len for r in requests)
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            block_size=block_size,
            num_kv_blocks=args.batch_size * (-(-longest // block_size) + 1),
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=max(1024, longest),
            dtype=args.dtype,
            device=args.device,
        )
    )

    def ours(batch: list[MixedRequest]) -> float:
        start = time.perf_counter()
        for i, r in enumerate(batch):
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(f"mixed-{start}-{i}", r.prompt, params)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    def theirs(batch: list[MixedRequest]) -> float:
        start = time.perf_counter()
        for first in range(0, len(batch), args.batch_size):
            static = batch[first : first + args.batch_size]
            width = max(len(r.prompt) for r in static)
            ids = torch.zeros(len(static), width, dtype=torch.int64)  # left padding
            mask = torch.zeros_like(ids)
            for row, r in enumerate(static):
                ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[row, width - len(r.prompt) :] = 1
            new_tokens = max(r.output_len for r in static)
            with torch.inference_mode():
                hf.generate(
                    ids.to(args.device),
                    attention_mask=mask.to(args.device),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
        return time.perf_counter() - start

    warm_up = mixed_requests(2, vocab, 0.05, 0.0, 8, args.seed + 1)
    ours(warm_up), theirs(warm_up)
    seconds_ours, seconds_theirs = ours(requests), theirs(requests)
    tokens = sum(r.output_len for r in requests)
    prompt_lens = sorted(len(r.prompt) for r in requests)
    output_lens = sorted(r.output_len for r in requests)
    print(
        f"model {model_dir} | {args.requests} requests, batch size {args.batch_size}, "
        f"{args.dtype}, {torch.get_num_threads()} threads, seed {args.seed}"
    )
    print(
        f"prompt tokens: mean {np.mean(prompt_lens):.0f}, median {np.median(prompt_lens):.0f}, "
        f"max {prompt_lens[-1]} | output tokens: mean {np.mean(output_lens):.0f}, "
        f"median {np.median(output_lens):.0f}, max {output_lens[-1]}"
    )
    print(f"{'engine':<30} {'seconds':>8} {'requests/s':>11} {'output tok/s':>13}")
    for name, seconds in (
        ("pdserve continuous batching", seconds_ours),
        ("transformers static batches", seconds_theirs),
    ):
        print(
            f"{name:<30} {seconds:>8.3f} {args.requests / seconds:>11.2f} {tokens / seconds:>13.1f}"
        )
    print(f"ratio (requests/s) {seconds_theirs / seconds_ours:.2f}x")
    return 0
