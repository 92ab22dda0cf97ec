"""The suite's workloads as probe samples: prompts (token ids, shared where the workload shares
them) and unit-rate arrivals, offered by the planner's probes at any rate.

    chat     ShareGPT-like chat turns (log-normal lengths around 200 in, 150 out)
    code     code completion: short in, short out (128-384 prompt, 16-48 output tokens)
    rag      summarization/RAG: 2k-6k-token prompts, 100-token answers
    agentic  multi-turn sessions: each turn's prompt is the session's whole history (a 1024-
             token system prompt shared by 8 sessions each, then 128-token messages and
             128-token answers), so a session's shared context grows turn by turn
    mix      the four above in equal parts, shuffled (agentic turns keep their order)
    phases   the four one after another, a quarter of each block each: the mix changes every
             quarter of a block (at rate r, every block / (4 r) simulated seconds)

Run by name only (`--suite-workloads long-rag`), outside the suite's cells:

    long-rag summarization of long documents: 6k-10k-token prompts, 100-token answers, where
             a colocated worker's prefill chunks, kept small for a tight TPOT, cannot finish a
             prompt within the TTFT SLO (issue 49 point 3's regime)

A probe offers a prefix of the sample (its first `block` requests, or several blocks for the
planner's longer steady probes), so agentic, mix and phases are built in consecutive blocks of
the probe's size, each a whole trace of the workload on its own: its sessions (every turn, in
rounds within the block) or its four phases. Built over the whole sample instead, a probe would
offer only the trace's start: first turns alone, or chat alone.

Arrivals are a Poisson process of unit rate over the whole sample; agentic turns arrive in
rounds (every session's first turn, then every second ...), not after the previous turn's answer.
"""

from __future__ import annotations

import numpy as np

from pdserve.core.prompt_tokens import PromptTokens
from pdserve.planner.workload import LAST_TOKEN, ProbeRequest
from pdserve.workloads.datasets import BenchRequest, DatasetConfig, generate_requests

BASIC = {
    "chat": DatasetConfig(name="chat-rag", rag_fraction=0.0),
    "code": DatasetConfig(
        name="random", random_input_len=256, random_output_len=32, random_range_ratio=0.5
    ),
    "rag": DatasetConfig(name="chat-rag", rag_fraction=1.0),
    "long-rag": DatasetConfig(
        name="chat-rag", rag_fraction=1.0, rag_min_input_len=6144, rag_max_input_len=10240
    ),
}
AGENTIC_TURNS = 8
WORKLOADS = ("chat", "code", "rag", "agentic", "mix", "phases")  # the suite's, by default
NAMED_WORKLOADS = (*WORKLOADS, "long-rag")  # and those run by name
# Block b is generated from seed + BLOCK_SEED_STRIDE * b: block 0 keeps the one-block sample
# (callers without blocks see the same trace), and blocks stay clear of the parts' seed + i.
BLOCK_SEED_STRIDE = 1000
# Token ids 0 and 1 are the built-in tokenizer's BOS and EOS.
AVOID = (0, 1)


def _agentic(n: int, seed: int) -> list[BenchRequest]:
    sessions = max(1, -(-n // AGENTIC_TURNS))
    config = DatasetConfig(
        name="multi-turn",
        mt_conversations=sessions,
        mt_turns=AGENTIC_TURNS,
        mt_system_prompts=max(1, sessions // 8),
    )
    return generate_requests(config, n, seed, LAST_TOKEN + 1, AVOID)


def _requests(name: str, n: int, seed: int) -> list[BenchRequest]:
    """Tagged by kind (chat-rag's own "chat"/"rag", "code", "agentic:c<session>")."""
    if name in BASIC:
        requests = generate_requests(BASIC[name], n, seed, LAST_TOKEN + 1, AVOID)
        for r in requests:
            r.tag = r.tag or name
        return requests
    if name == "agentic":
        requests = _agentic(n, seed)
        for r in requests:
            r.tag = f"agentic:{r.tag}"
        return requests
    parts = [_requests(kind, -(-n // 4), seed + i) for i, kind in enumerate(WORKLOADS[:4])]
    if name == "phases":
        return [r for part in parts for r in part][:n]
    if name == "mix":
        # Shuffled positions, each kind's requests in their own order (agentic rounds kept).
        kinds = np.random.default_rng(seed).permutation(np.repeat(np.arange(4), len(parts[0])))
        taken = [iter(part) for part in parts]
        return [next(taken[k]) for k in kinds][:n]
    raise ValueError(f"workload {name!r}: one of {', '.join(NAMED_WORKLOADS)}")


def _blocks(name: str, n: int, block: int, seed: int) -> list[BenchRequest]:
    """`n` requests in consecutive blocks of `block`, each a whole trace of the workload; agentic
    sessions are renumbered so that no two blocks share a session's tag."""
    requests: list[BenchRequest] = []
    for b, start in enumerate(range(0, n, block)):
        requests += _requests(name, block, seed + BLOCK_SEED_STRIDE * b)[: n - start]
    for index, r in enumerate(requests):
        if r.tag.startswith("agentic:c"):
            r.tag = f"agentic:c{index // block}.{r.tag.removeprefix('agentic:c')}"
    return requests


def suite_sample(name: str, n: int, seed: int = 0, block: int | None = None) -> list[ProbeRequest]:
    """`n` requests of workload `name` as a probe sample, the same for the same arguments.

    `block` is the probe's size (default `n`): agentic, mix and phases repeat their whole trace
    every `block` requests, so that every prefix of whole blocks offers the workload."""
    block = n if block is None else block
    if block < 1:
        raise ValueError(f"block: {block}, must be at least 1")
    requests = _requests(name, n, seed) if name in BASIC else _blocks(name, n, block, seed)
    arrivals = np.cumsum(np.random.default_rng([seed, 1]).exponential(1.0, len(requests)))
    return [
        ProbeRequest(i, PromptTokens(r.prompt), r.output_len, float(t), r.tag)
        for i, (r, t) in enumerate(zip(requests, arrivals, strict=True))
    ]
