"""The sim experiments' workloads: chat-rag (chat among long prompts) and multi-turn chat."""

from __future__ import annotations

import pytest

from pdserve.workloads.datasets import DatasetConfig, default_num_requests, generate_requests

VOCAB = 500
EOS = (1,)


def test_chat_rag_has_exactly_its_share_of_long_prompts_within_bounds():
    config = DatasetConfig("chat-rag", rag_fraction=0.25, rag_min_input_len=300,
                           rag_max_input_len=400, chat_max_input_len=200,
                           chat_max_output_len=90)  # fmt: skip
    requests = generate_requests(config, 40, seed=1, vocab_size=VOCAB, avoid_token_ids=EOS)
    assert requests == generate_requests(config, 40, 1, VOCAB, EOS)
    rag = [r for r in requests if r.tag == "rag"]
    chat = [r for r in requests if r.tag == "chat"]
    assert len(rag) == 10 and len(chat) == 30
    assert all(300 <= r.prompt_len <= 400 and r.output_len == config.rag_output_len for r in rag)
    assert all(4 <= r.prompt_len <= 200 and 4 <= r.output_len <= 90 for r in chat)
    assert len({r.prompt_len for r in chat}) > 10  # lengths vary, as chat turns do
    assert all(len(r.prompt) == r.prompt_len and 1 not in r.prompt for r in requests)


def test_multi_turn_prompts_extend_the_previous_turn_of_their_conversation():
    config = DatasetConfig("multi-turn", mt_conversations=6, mt_turns=3, mt_system_prompts=2,
                           mt_system_prompt_len=20, mt_user_len=5, mt_output_len=4)  # fmt: skip
    assert default_num_requests(config) == 18
    requests = generate_requests(config, 18, seed=2, vocab_size=VOCAB, avoid_token_ids=EOS)
    by_conversation: dict[str, list] = {}
    for r in requests:
        by_conversation.setdefault(r.tag, []).append(r)
    assert len(by_conversation) == 6
    for turns in by_conversation.values():
        assert [t.prompt_len for t in turns] == [25, 34, 43]  # + answer (4) + user message (5)
        for previous, turn in zip(turns, turns[1:], strict=False):
            assert turn.prompt[: previous.prompt_len] == previous.prompt
    # Rounds: every conversation's turn k comes before any turn k + 1.
    assert [r.prompt_len for r in requests] == [25] * 6 + [34] * 6 + [43] * 6
    # Two system prompts shared among six conversations.
    assert len({tuple(r.prompt[:20]) for r in requests}) == 2


def test_multi_turn_refuses_more_requests_than_it_has():
    with pytest.raises(ValueError, match="multi-turn has 4 requests"):
        generate_requests(DatasetConfig("multi-turn", mt_conversations=2, mt_turns=2), 5, 0, VOCAB)
