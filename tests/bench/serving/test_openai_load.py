"""What `bench serve --backend openai` reads of a server: the stream's deliveries (ITL) and the
vocabulary of its model card."""

from __future__ import annotations

import json

from pdserve.bench.serving.openai_load import _take, card_vocab_size
from pdserve.models.builtin import BUILTIN_VERSION
from pdserve.models.presets import PRESETS
from pdserve.workloads.metrics import RequestRecord


def _event(token_ids: list[int]) -> bytes:
    choice = {"index": 0, "text": "x" * len(token_ids), "token_ids": token_ids}
    return b"data: " + json.dumps({"choices": [choice]}).encode()


def test_events_read_together_are_one_delivery_and_no_zero_gap():
    record = RequestRecord(index=0, request_id="r", prompt_len=4, max_tokens=6)
    record.send_time = 0.0
    # One read at 0.10 s carried two events, one at 0.13 s one event, one at 0.19 s two.
    for now, ids in [(0.10, [1]), (0.10, [2, 3]), (0.13, [4]), (0.19, [5]), (0.19, [6])]:
        _take(_event(ids), now, record)
    assert record.chunk_times == [0.10, 0.13, 0.19]
    assert record.chunk_tokens == [3, 1, 2]
    assert [round(g, 6) for g in record.itls] == [0.03, 0.06]
    # Per token, a delivery's gap is spread over its tokens (vLLM's and SGLang's ITL per token).
    assert [round(g, 6) for g in record.token_itls] == [0.03, 0.03, 0.03]
    assert min(record.itls) > 0


def test_the_vocabulary_comes_from_the_card_or_the_builtin_model():
    assert card_vocab_size({"id": "some-model", "vocab_size": 32000}) == 32000
    builtin = f"tiny-llama-v{BUILTIN_VERSION}"
    assert card_vocab_size({"id": builtin}) == PRESETS["tiny"]["vocab_size"]
    assert (
        card_vocab_size({"id": f"small-llama-v{BUILTIN_VERSION}"}) == PRESETS["small"]["vocab_size"]
    )
    assert card_vocab_size({"id": "tiny-chat"}) is None
    assert card_vocab_size({"id": "nonesuch-llama-v1"}) is None
