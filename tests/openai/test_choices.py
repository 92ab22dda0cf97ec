"""Stream chunks on the wire: the JSON of each one is exactly OpenAI's chunk object, compact,
for completions and chat, first and later chunks, every optional part and any text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.messages import TokenBatch
from pdserve.models.tokenizer_builder import write_tokenizer
from pdserve.tokenizer import Tokenizer
from router.http.choices import Choice, ResponseShape
from router.types import Progress


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, 512)
    return Tokenizer.from_dir(directory)


def compact(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def taken(choice: Choice, batch: TokenBatch) -> TokenBatch:
    choice.add(batch)
    return batch


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    text=texts,
    chat=st.booleans(),
    first=st.booleans(),
    finished=st.booleans(),
    return_token_ids=st.booleans(),
    index=st.integers(0, 5),
)
def test_a_chunk_is_openais_object_in_compact_json(
    text, chat, first, finished, return_token_ids, index
) -> None:
    shape = ResponseShape(
        id='cmpl-a"b', model="tiny/ü", chat=chat, tokenizer=None, return_token_ids=return_token_ids
    )
    choice = Choice(index, [7, 8, 9], Progress(received=0.0, prompt_tokens=3))
    batch = taken(
        choice,
        TokenBatch("r", [11, 12], [], text, finished=finished, finish_reason="length"),
    )
    if not chat:
        content: dict = {"text": text}
    elif first:
        content = {"delta": {"role": "assistant", "content": text}}
    else:
        content = {"delta": {"content": text}}
    expected_choice = {
        "index": index,
        **content,
        "logprobs": None,
        "finish_reason": "length" if finished else None,
    }
    if return_token_ids:
        expected_choice["token_ids"] = [11, 12]
        if first:
            expected_choice["prompt_token_ids"] = [7, 8, 9]
    expected = {
        "id": 'cmpl-a"b',
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": shape.created,
        "model": "tiny/ü",
        "choices": [expected_choice],
    }
    assert shape.chunk(choice, batch, first) == compact(expected)


@pytest.mark.parametrize("chat", [False, True])
def test_a_chunks_logprobs_are_those_of_its_own_tokens(tokenizer, chat) -> None:
    shape = ResponseShape(id="x", model="m", chat=chat, tokenizer=tokenizer, logprobs=True)
    choice = Choice(0, [1], Progress(received=0.0, prompt_tokens=1))
    taken(choice, TokenBatch("r", [40], [-0.5], tokenizer.decode([40])))
    later = taken(
        choice,
        TokenBatch(
            "r", [41, 42], [-1.25, -0.125], "".join(tokenizer.decode([t]) for t in (41, 42))
        ),
    )
    parsed = json.loads(shape.chunk(choice, later, first=False))
    tokens = [tokenizer.decode([t]) for t in (41, 42)]
    if chat:
        assert parsed["choices"][0]["logprobs"] == {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, [-1.25, -0.125], strict=True)
            ]
        }
    else:
        offset = len(tokenizer.decode([40]))
        assert parsed["choices"][0]["logprobs"] == {
            "tokens": tokens,
            "token_logprobs": [-1.25, -0.125],
            "top_logprobs": [{tokens[0]: -1.25}, {tokens[1]: -0.125}],
            "text_offset": [offset, offset + len(tokens[0])],
        }


def test_the_usage_chunk_has_no_choice_and_the_usage_of_all() -> None:
    shape = ResponseShape(id="x", model="m", chat=True, tokenizer=None)
    choices = [Choice(i, [1, 2], Progress(received=0.0, prompt_tokens=2)) for i in range(2)]
    for choice in choices:
        choice.progress.completion_tokens, choice.progress.cached_tokens = 3, 1
    assert json.loads(shape.usage_chunk(choices)) == {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": shape.created,
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 6,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    }


def test_a_chunk_carries_the_usage_so_far_when_given() -> None:
    shape = ResponseShape(id="x", model="m", chat=False, tokenizer=None)
    choice = Choice(0, [1, 2], Progress(received=0.0, prompt_tokens=2))
    batch = taken(choice, TokenBatch("r", [9], [], "a"))
    so_far = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert shape.chunk(choice, batch, first=True, usage_so_far=so_far) == compact(
        {
            "id": "x",
            "object": "text_completion",
            "created": shape.created,
            "model": "m",
            "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
            "usage": so_far,
        }
    )
