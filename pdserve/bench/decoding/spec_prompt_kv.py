"""`pdserve bench spec --prompt-kv LENGTHS`: where a disaggregated pair should compute the
draft's KV of the prompt (issue 17 point 1).

Option A, the decode worker computes it (what DraftProposer does: one chunked draft forward at
the request's first speculative step): costs the decode worker that forward, once. Option B,
the prefill worker computes and sends it: costs the prefill worker the same forward plus the
draft's KV bytes over the transfer (at `--transfer-gbps`). Printed per prompt length: the
draft's prompt forward (median of `--repeats`, measured through DraftProposer), the target's
prefill of the same prompt (for scale), the draft KV bytes and their transfer time. Times by
`clock` (`--clock`), like the rest of the benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable


def report(
    args: argparse.Namespace,
    target: str,
    draft: str,
    lengths: list[int],
    clock: Callable[[], float],
) -> None:
    import torch

    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sequence import Sequence
    from pdserve.engine.speculation.draft_model_proposer import DraftProposer
    from pdserve.engine_config import EngineConfig, SpeculativeConfig

    block_size = 16
    num_blocks = 2 * (-(-max(lengths) // block_size) + 1)
    spec = SpeculativeConfig(method="draft", draft_model=draft)
    config = EngineConfig(
        model=target,
        device=args.device,
        dtype=args.dtype,
        compile=False,  # prefill only: the compiled decode graph would never run
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=max(lengths) + 1,
        enable_prefix_caching=False,
    )
    proposer = DraftProposer(dataclasses.replace(config, speculative=spec), num_blocks)
    engine = LLMEngine(config)
    vocab = engine.executor.vocab_size
    cache = proposer.kv_cache
    bytes_per_token = cache[:, :, 0, 0].numel() * cache.element_size()
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print(
        f"draft prompt KV ({cache.shape[0]} layers, {bytes_per_token} bytes/token) at "
        f"{args.transfer_gbps} GB/s"
    )
    print(
        f"{'prompt':>7} {'draft fwd ms':>12} {'target prefill ms':>17} {'draft KV MiB':>12} "
        f"{'transfer ms':>11} {'B / A':>6}"
    )
    for length in lengths:
        draft_times, target_times = [], []
        for rep in range(args.repeats + 1):  # the first of each is a warm-up
            prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
            manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
            seq = Sequence(f"p{rep}", prompt, length, greedy, arrival=0)
            manager.ensure_blocks(seq, length)
            seq.num_computed_tokens = length - 1
            began = clock()
            proposer.propose([seq], 1)
            draft_times.append(clock() - began)
            proposer.forget(seq)
            engine.add_request(f"t{length}-{rep}", prompt, greedy)
            began = clock()
            while engine.has_unfinished():
                engine.step()
            target_times.append(clock() - began)
        forward = statistics.median(draft_times[1:])
        prefill = statistics.median(target_times[1:])
        kv_bytes = length * bytes_per_token
        transfer = kv_bytes / (args.transfer_gbps * 1e9)
        print(
            f"{length:>7} {forward * 1e3:12.1f} {prefill * 1e3:17.1f} {kv_bytes / 2**20:12.2f} "
            f"{transfer * 1e3:11.1f} {(forward + transfer) / forward:5.2f}x"
        )
