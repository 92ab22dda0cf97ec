"""Workload generators: deterministic for a seed, and exact about lengths and proportions."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.workloads.datasets import DatasetConfig, default_num_requests, generate_requests

VOCAB = 50
EOS = (0, 7)


def test_random_is_a_pure_function_of_config_seed_and_vocab():
    config = DatasetConfig(
        "random", random_input_len=32, random_output_len=8, random_range_ratio=0.5
    )
    first = generate_requests(config, 20, seed=3, vocab_size=VOCAB, avoid_token_ids=EOS)
    again = generate_requests(config, 20, seed=3, vocab_size=VOCAB, avoid_token_ids=EOS)
    other = generate_requests(config, 20, seed=4, vocab_size=VOCAB, avoid_token_ids=EOS)
    assert first == again
    assert first != other


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    input_len=st.integers(1, 64),
    output_len=st.integers(1, 64),
    ratio=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
)
def test_random_lengths_stay_in_range_and_prompts_avoid_eos(seed, input_len, output_len, ratio):
    config = DatasetConfig("random", input_len, output_len, ratio)
    requests = generate_requests(config, 16, seed, VOCAB, EOS)
    for r in requests:
        assert max(1, int(input_len * (1 - ratio))) <= r.prompt_len <= input_len * (1 + ratio) + 1
        assert max(1, int(output_len * (1 - ratio))) <= r.output_len <= output_len * (1 + ratio) + 1
        assert len(r.prompt) == r.prompt_len
        assert all(0 <= t < VOCAB and t not in EOS for t in r.prompt)
    if ratio == 0.0:
        assert {(r.prompt_len, r.output_len) for r in requests} == {(input_len, output_len)}


def test_eos_ids_never_appear_even_in_a_large_sample():
    config = DatasetConfig("random", random_input_len=2000, random_output_len=1)
    (request,) = generate_requests(config, 1, 0, VOCAB, EOS)
    assert set(request.prompt) == set(range(VOCAB)) - set(EOS)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    config = DatasetConfig(
        "shared-prefix",
        gsp_num_groups=4,
        gsp_prompts_per_group=5,
        gsp_system_prompt_len=12,
        gsp_question_len=6,
        gsp_output_len=9,
    )
    assert default_num_requests(config) == 20
    requests = generate_requests(config, 20, 1, VOCAB * 100)
    assert requests == generate_requests(config, 20, 1, VOCAB * 100)
    assert Counter(r.tag for r in requests) == {f"g{g}": 5 for g in range(4)}
    assert {(r.prompt_len, r.output_len) for r in requests} == {(18, 9)}
    prefixes = {r.tag: set() for r in requests}
    for r in requests:
        prefixes[r.tag].add(tuple(r.prompt[:12]))
    assert all(len(p) == 1 for p in prefixes.values())  # one system prompt per group
    assert len({p.pop() for p in prefixes.values()}) == 4  # and different across groups
    assert [r.tag for r in requests] != sorted(r.tag for r in requests)  # groups interleave
    assert generate_requests(config, 7, 1, VOCAB * 100) == requests[:7]
    with pytest.raises(ValueError, match="20 requests"):
        generate_requests(config, 21, 1, VOCAB)


@pytest.mark.parametrize(
    ("n", "fraction", "expected_long"), [(100, 0.1, 10), (7, 0.5, 4), (5, 0, 0)]
)
def test_mixed_has_the_exact_proportion_of_long_requests(n, fraction, expected_long):
    config = DatasetConfig(
        "mixed",
        mixed_long_fraction=fraction,
        mixed_long_input_len=64,
        mixed_long_output_len=2,
        mixed_short_input_len=8,
        mixed_short_output_len=16,
    )
    requests = generate_requests(config, n, 5, VOCAB, EOS)
    assert requests == generate_requests(config, n, 5, VOCAB, EOS)
    long = [r for r in requests if r.tag == "long"]
    short = [r for r in requests if r.tag == "short"]
    assert len(long) == expected_long and len(short) == n - expected_long
    assert {(r.prompt_len, r.output_len, len(r.prompt)) for r in long} <= {(64, 2, 64)}
    assert {(r.prompt_len, r.output_len, len(r.prompt)) for r in short} <= {(8, 16, 8)}


def _conversation(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


@pytest.fixture
def sharegpt_file(tmp_path):
    conversations = [
        _conversation(("human", "one two three four five"), ("gpt", "a b c d e f")),
        _conversation(("system", "be nice"), ("human", "w x y z q"), ("gpt", "1 2 3 4")),
        _conversation(("human", "too short"), ("gpt", "a b c d")),  # prompt < 4: skipped
        _conversation(("human", "p q r s"), ("gpt", "ok")),  # reply < 4: skipped
        _conversation(("human", "only a question with no answer")),  # no pair: skipped
        {"not": "a conversation"},
        _conversation(("human", " ".join(["w"] * 30)), ("gpt", " ".join(["r"] * 30))),  # > 50
        _conversation(("human", "h i j k l m"), ("gpt", "n o p q r s t")),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    return path


def test_sharegpt_uses_first_human_turn_and_reply_length(sharegpt_file):
    config = DatasetConfig(f"sharegpt:{sharegpt_file}", sharegpt_max_len=50)
    requests = generate_requests(config, 3, 0, VOCAB)
    assert requests == generate_requests(config, 3, 0, VOCAB)
    by_prompt = {r.prompt: (r.prompt_len, r.output_len) for r in requests}
    assert by_prompt == {
        "one two three four five": (5, 6),
        "w x y z q": (5, 4),
        "h i j k l m": (6, 7),
    }
    with pytest.raises(ValueError, match="only 3 usable"):
        generate_requests(config, 4, 0, VOCAB)


def test_sharegpt_counts_tokens_with_the_given_tokenizer(sharegpt_file):
    config = DatasetConfig(f"sharegpt:{sharegpt_file}", sharegpt_max_len=10_000)

    def tokenize(text: str) -> list[int]:  # two tokens per word
        return [1, 2] * len(text.split())

    requests = generate_requests(config, 4, 0, VOCAB, tokenize=tokenize)
    assert {r.prompt: (r.prompt_len, r.output_len) for r in requests}["w x y z q"] == (10, 8)
    assert len(requests) == 4  # "too short" now has 4 tokens; the 30-word one fits


def test_bad_settings_are_rejected_with_the_flag_name(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        generate_requests(DatasetConfig("nope"), 1, 0, VOCAB)
    with pytest.raises(ValueError, match="--random-range-ratio"):
        generate_requests(DatasetConfig(random_range_ratio=1.0), 1, 0, VOCAB)
    with pytest.raises(ValueError, match="--gsp-question-len"):
        generate_requests(DatasetConfig("shared-prefix", gsp_question_len=0), 1, 0, VOCAB)
    with pytest.raises(ValueError, match="cannot read ShareGPT"):
        generate_requests(DatasetConfig(f"sharegpt:{tmp_path / 'missing.json'}"), 1, 0, VOCAB)
