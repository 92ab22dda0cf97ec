"""Benchmark request sets: random, shared-prefix, mixed long/short, chat-rag (ShareGPT-like chat
among long summarization/RAG prompts), multi-turn chat, and ShareGPT.

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

DATASETS = ("random", "shared-prefix", "mixed", "chat-rag", "multi-turn", "sharegpt:FILE")


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

    name: str = "random"  # one of DATASETS, "sharegpt:PATH" for the last
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
    # chat-rag: chat turns with log-normal lengths (median, sigma of the log), clipped to
    # [4, chat_max_input_len] and [4, chat_max_output_len], among long prompts uniform in
    # [rag_min_input_len, rag_max_input_len].
    chat_input_median: int = 200
    chat_output_median: int = 150
    chat_sigma: float = 0.8
    chat_max_input_len: int = 2048
    chat_max_output_len: int = 512
    rag_fraction: float = 0.3
    rag_min_input_len: int = 2048
    rag_max_input_len: int = 6144
    rag_output_len: int = 100
    # multi-turn: conversations of mt_turns turns, each opening with one of mt_system_prompts
    # system prompts; a turn's prompt is the previous turn's prompt + its answer + a new user
    # message (answers as long as the turn's output).
    mt_conversations: int = 64
    mt_turns: int = 4
    mt_system_prompts: int = 8
    mt_system_prompt_len: int = 1024
    mt_user_len: int = 128
    mt_output_len: int = 128

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting."""
        known = self.name in DATASETS[:-1] or self.name.startswith("sharegpt:")
        if not known:
            raise ValueError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        for name in ("mixed_long_fraction", "rag_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")
        if self.rag_min_input_len > self.rag_max_input_len:
            raise ValueError("--rag-min-input-len must be <= --rag-max-input-len")
        counts = (
            "_len",
            "_groups",
            "_per_group",
            "_median",
            "_conversations",
            "_turns",
            "_prompts",
        )
        for name, value in vars(self).items():
            if name.endswith(counts) and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def default_num_requests(config: DatasetConfig) -> int:
    """Requests in the workload when --num-requests is not given."""
    if config.name == "shared-prefix":
        return config.gsp_num_groups * config.gsp_prompts_per_group
    if config.name == "multi-turn":
        return config.mt_conversations * config.mt_turns
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
    if config.name == "chat-rag":
        return _chat_rag(config, num_requests, rng, allowed)
    if config.name == "multi-turn":
        return _multi_turn(config, num_requests, rng, allowed)
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


def _chat_rag(config, n, rng, allowed) -> list[BenchRequest]:
    """ShareGPT-like chat turns (log-normal input and output lengths, heavy-tailed as in the
    ShareGPT traces) and long summarization/RAG prompts with short answers; exactly
    round(n x rag_fraction) long ones ("rag"), shuffled among the chats ("chat")."""
    num_rag = round(n * config.rag_fraction)
    is_rag = np.zeros(n, dtype=bool)
    is_rag[rng.permutation(n)[:num_rag]] = True

    def lognormal(median: int, longest: int) -> int:
        value = median * math.exp(config.chat_sigma * rng.standard_normal())
        return int(min(longest, max(4, round(value))))

    requests = []
    for rag in is_rag:
        if rag:
            in_len = int(rng.integers(config.rag_min_input_len, config.rag_max_input_len + 1))
            out_len, tag = config.rag_output_len, "rag"
        else:
            in_len = lognormal(config.chat_input_median, config.chat_max_input_len)
            out_len = lognormal(config.chat_output_median, config.chat_max_output_len)
            tag = "chat"
        requests.append(BenchRequest(_tokens(rng, allowed, in_len), in_len, out_len, tag))
    return requests


def _multi_turn(config, n, rng, allowed) -> list[BenchRequest]:
    """Conversations sharing system prompts, in rounds: every conversation's first turn (in a
    shuffled order), then every second turn, and so on, so a conversation's next turn comes a
    round after its previous one, as a user's reply follows the answer. Tags are "c<conv>".
    The first `n` requests are kept (n <= conversations x turns)."""
    total = config.mt_conversations * config.mt_turns
    if n > total:
        raise ValueError(f"multi-turn has {total} requests (conversations x turns), asked for {n}")
    systems = [
        _tokens(rng, allowed, config.mt_system_prompt_len) for _ in range(config.mt_system_prompts)
    ]
    history = [
        list(systems[int(rng.integers(config.mt_system_prompts))])
        for _ in range(config.mt_conversations)
    ]
    requests = []
    for _ in range(config.mt_turns):
        for conv in rng.permutation(config.mt_conversations):
            history[conv] += _tokens(rng, allowed, config.mt_user_len)
            prompt = list(history[conv])
            requests.append(BenchRequest(prompt, len(prompt), config.mt_output_len, f"c{conv}"))
            history[conv] += _tokens(rng, allowed, config.mt_output_len)  # its answer
    return requests[:n]


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
