"""Benchmark request sets: random, shared-prefix, mixed long/short, and ShareGPT.

Every generator is a pure function of (DatasetConfig, num_requests, seed, vocab_size, and the
ids to avoid), so a seed names a workload exactly. Synthetic prompts are random token ids
drawn from the served vocabulary without the EOS ids, and each request asks for exactly
`output_len` tokens (the load generator sets `ignore_eos`), so lengths are controlled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("random", "shared-prefix", "mixed", "sharegpt:FILE")


@dataclass
class BenchRequest:
    """One request of a workload. `prompt` is token ids, or text (ShareGPT)."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int  # sent as max_tokens (with ignore_eos)
    tag: str = ""  # class of the request, e.g. "long"/"short" in the mixed dataset


@dataclass
class DatasetConfig:
    """Shape of a workload; fields mirror the `pdserve bench serve` flags."""

    name: str = "random"  # "random" | "shared-prefix" | "mixed" | "sharegpt:PATH"
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0  # lengths uniform in [len*(1-r), len*(1+r)]
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    mixed_long_fraction: float = 0.1
    mixed_long_input_len: int = 4096
    mixed_long_output_len: int = 32
    mixed_short_input_len: int = 128
    mixed_short_output_len: int = 256
    sharegpt_max_len: int = 2048  # conversations with prompt + answer longer than this are skipped

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting."""
        known = self.name in DATASETS[:3] or self.name.startswith("sharegpt:")
        if not known:
            raise ValueError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        if not 0 <= self.mixed_long_fraction <= 1:
            raise ValueError("--mixed-long-fraction must be in [0, 1]")
        for name, value in vars(self).items():
            if name.endswith(("_len", "_groups", "_per_group")) and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def default_num_requests(config: DatasetConfig) -> int:
    """Requests in the workload when --num-requests is not given."""
    if config.name == "shared-prefix":
        return config.gsp_num_groups * config.gsp_prompts_per_group
    return 1000


def generate_requests(
    config: DatasetConfig,
    num_requests: int,
    seed: int,
    vocab_size: int,
    avoid_token_ids: Sequence[int] = (),
    tokenize: Callable[[str], list[int]] | None = None,
) -> list[BenchRequest]:
    """The workload: `num_requests` requests, the same for the same arguments.

    `avoid_token_ids` (the EOS ids) never appear in synthetic prompts. `tokenize` is used by
    ShareGPT only, to count tokens; without it lengths are counted in words.
    """
    config.validate()
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(avoid_token_ids, dtype=np.int64))
    if config.name == "random":
        return _random(config, num_requests, rng, allowed)
    if config.name == "shared-prefix":
        return _shared_prefix(config, num_requests, rng, allowed)
    if config.name == "mixed":
        return _mixed(config, num_requests, rng, allowed)
    path = Path(config.name.removeprefix("sharegpt:"))
    return _sharegpt(config, num_requests, rng, path, tokenize)


def _tokens(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    return allowed[rng.integers(0, len(allowed), size=n)].tolist()


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """n lengths uniform on the integers of [mean*(1-ratio), mean*(1+ratio)], at least 1."""
    low, high = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _random(config, n, rng, allowed) -> list[BenchRequest]:
    inputs = _lengths(rng, config.random_input_len, config.random_range_ratio, n)
    outputs = _lengths(rng, config.random_output_len, config.random_range_ratio, n)
    return [
        BenchRequest(_tokens(rng, allowed, int(i)), int(i), int(o))
        for i, o in zip(inputs, outputs, strict=True)
    ]


def _shared_prefix(config, n, rng, allowed) -> list[BenchRequest]:
    """SGLang's generated-shared-prefix: groups sharing a system prompt, each with questions.

    The order is shuffled so groups interleave, as concurrent users of several apps would; the
    first `n` requests are kept (n <= groups x prompts per group).
    """
    total = config.gsp_num_groups * config.gsp_prompts_per_group
    if n > total:
        raise ValueError(f"shared-prefix has {total} requests (groups x prompts), asked for {n}")
    requests = []
    for group in range(config.gsp_num_groups):
        system = _tokens(rng, allowed, config.gsp_system_prompt_len)
        for _ in range(config.gsp_prompts_per_group):
            prompt = system + _tokens(rng, allowed, config.gsp_question_len)
            requests.append(BenchRequest(prompt, len(prompt), config.gsp_output_len, f"g{group}"))
    order = rng.permutation(total)[:n]
    return [requests[i] for i in order]


def _mixed(config, n, rng, allowed) -> list[BenchRequest]:
    """Long-prompt and short-chat requests; exactly round(n x fraction) long ones, shuffled."""
    num_long = round(n * config.mixed_long_fraction)
    is_long = np.zeros(n, dtype=bool)
    is_long[rng.permutation(n)[:num_long]] = True
    requests = []
    for long in is_long:
        if long:
            in_len, out_len = config.mixed_long_input_len, config.mixed_long_output_len
        else:
            in_len, out_len = config.mixed_short_input_len, config.mixed_short_output_len
        tag = "long" if long else "short"
        requests.append(BenchRequest(_tokens(rng, allowed, in_len), in_len, out_len, tag))
    return requests


def _sharegpt(config, n, rng, path: Path, tokenize) -> list[BenchRequest]:
    """First human turn as the (text) prompt; the reply's length (tokens, or words) sets
    max_tokens. Token counts come from `tokenize` (e.g. the server's Tokenize RPC).

    Like vLLM, conversations whose prompt or reply is shorter than 4 tokens, or whose total
    exceeds `sharegpt_max_len`, are skipped.
    """
    try:
        conversations = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read ShareGPT file {path}: {error}") from error
    count = tokenize or str.split  # words approximate tokens when no tokenizer is at hand
    requests = []
    for index in rng.permutation(len(conversations)):
        pair = _first_exchange(conversations[index])
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len, output_len = len(count(prompt)), len(count(reply))
        if prompt_len < 4 or output_len < 4 or prompt_len + output_len > config.sharegpt_max_len:
            continue
        requests.append(BenchRequest(prompt, prompt_len, output_len))
        if len(requests) == n:
            return requests
    raise ValueError(f"{path} has only {len(requests)} usable conversations, asked for {n}")


def _first_exchange(conversation: object) -> tuple[str, str] | None:
    """(first human turn, the gpt turn right after it), or None if there is no such pair."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, answer in zip(turns, turns[1:], strict=False):
        if not (isinstance(turn, dict) and isinstance(answer, dict)):
            return None
        if turn.get("from") == "human" and answer.get("from") == "gpt":
            return str(turn.get("value", "")), str(answer.get("value", ""))
    return None
