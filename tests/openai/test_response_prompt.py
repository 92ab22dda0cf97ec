"""A Responses continuation's prompt starts with exactly the previous turn's prompt and output
tokens (the KV its worker holds), whatever the tokenizer would make of their text; and falls
back to tokenizing the whole conversation when the text does not continue the previous turn."""

from __future__ import annotations

import pytest

from pdserve.models.tokenizer_builder import EOS_TOKEN_ID, write_tokenizer
from pdserve.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate
from router.http.response_prompt import continuation, input_messages, with_instructions
from router.http.response_schemas import ResponsesRequest
from router.http.response_store import StoredResponse
from router.validation import RequestError


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Tokenizer, ChatTemplate]:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, 512)
    return Tokenizer.from_dir(directory), ChatTemplate.from_dir(directory)


def first_turn(model, output_ids: list[int], instructions: str | None = "Be brief."):
    """The record of a first turn that generated `output_ids`."""
    tokenizer, template = model
    conversation = [{"role": "user", "content": "Hello there"}]
    text = template.render(with_instructions(instructions, conversation))
    output = tokenizer.decode(output_ids)
    return StoredResponse(
        response={},
        conversation=[*conversation, {"role": "assistant", "content": output}],
        prompt_text=text,
        prompt_ids=tokenizer.encode(text, add_special_tokens=False),
        output_ids=output_ids,
    )


def next_prompt(model, previous: StoredResponse, instructions: str | None = "Be brief."):
    tokenizer, template = model
    conversation = [*previous.conversation, {"role": "user", "content": "And then?"}]
    rendered = template.render(with_instructions(instructions, conversation))
    return rendered, continuation(rendered, previous, tokenizer)


def test_the_next_prompt_starts_with_the_generated_tokens_not_their_retokenization(model):
    tokenizer = model[0]
    # "hello" as single-byte tokens: the tokenizer spells it otherwise (with merges).
    output_ids = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "hello"]
    assert tokenizer.encode("hello", add_special_tokens=False) != output_ids
    previous = first_turn(model, [*output_ids, EOS_TOKEN_ID])
    rendered, follows = next_prompt(model, previous)
    assert follows is not None
    # The prompt, the output and its stop token as computed, then the rest of the text.
    assert follows.prefix_ids == previous.prompt_ids + output_ids + [EOS_TOKEN_ID]
    assert follows.rest == "\nuser: And then?\nassistant: "
    whole = follows.prefix_ids + tokenizer.encode(follows.rest, add_special_tokens=False)
    assert tokenizer.decode(whole, skip_special_tokens=False) == rendered


def test_an_output_cut_by_length_keeps_its_tokens_and_the_template_adds_the_stop(model):
    tokenizer = model[0]
    output_ids = tokenizer.encode("cut short", add_special_tokens=False)
    previous = first_turn(model, output_ids)
    rendered, follows = next_prompt(model, previous)
    assert follows.prefix_ids == previous.prompt_ids + output_ids
    assert follows.rest.startswith("</s>\nuser: ")
    whole = follows.prefix_ids + tokenizer.encode(follows.rest, add_special_tokens=False)
    assert tokenizer.decode(whole, skip_special_tokens=False) == rendered


def test_other_instructions_change_the_prefix_and_the_whole_text_is_tokenized(model):
    tokenizer = model[0]
    previous = first_turn(model, [*tokenizer.encode("ok", add_special_tokens=False), 1])
    assert next_prompt(model, previous, instructions="Be verbose.")[1] is None
    assert next_prompt(model, previous, instructions=None)[1] is None


def test_input_items_become_chat_messages(model):
    body = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},  # noqa: E501
                {"role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]},
            ]
        }
    )  # fmt: skip
    assert input_messages(body, []) == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]},
    ]
    assert input_messages(ResponsesRequest(input="Hi"), []) == [{"role": "user", "content": "Hi"}]


def _call(call_id: str, name: str = "f", arguments: str = '{"x": 1}') -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def _tool_call(call_id: str, name: str = "f", arguments: str = '{"x": 1}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_calls_in_a_row_are_one_assistant_message_and_outputs_are_tool_messages():
    items = [
        {"role": "user", "content": "Go."},
        _call("call_a"),
        _call("call_b", "g", "{}"),
        {"type": "function_call_output", "call_id": "call_b", "output": "2"},
        {"type": "function_call_output", "call_id": "call_a", "output": [{"type": "input_text", "text": "1"}]},  # noqa: E501
    ]  # fmt: skip
    body = ResponsesRequest.model_validate({"input": items})
    assert input_messages(body, []) == [
        {"role": "user", "content": "Go."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_tool_call("call_a"), _tool_call("call_b", "g", "{}")],
        },
        {"role": "tool", "tool_call_id": "call_b", "content": "2"},
        {"role": "tool", "tool_call_id": "call_a", "content": "1"},
    ]


def test_an_output_may_answer_a_call_of_the_stored_conversation():
    earlier = [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": None, "tool_calls": [_tool_call("call_s")]},
    ]
    output = {"type": "function_call_output", "call_id": "call_s", "output": "ok"}
    body = ResponsesRequest.model_validate({"input": [output]})
    assert input_messages(body, earlier) == [
        {"role": "tool", "tool_call_id": "call_s", "content": "ok"}
    ]
    with pytest.raises(RequestError, match=r"^input\[0\]\.call_id: 'call_s' answers no earlier"):
        input_messages(body, [])


@pytest.mark.parametrize(
    "items, field",
    [
        ([], "input"),
        ([{"type": "function_call_output", "call_id": "c", "output": "1"}], "input[0].call_id"),
        ([{"type": "reasoning", "summary": []}], "input[0].type"),
        ([_call("c", arguments="{")], "input[0].arguments"),
        ([_call("c", arguments="[1]")], "input[0].arguments"),
        ([{"type": "function_call", "call_id": "c", "arguments": "{}"}], "input[0].name"),
        ([_call("c"), {"type": "function_call_output", "call_id": "c"}], "input[1].output"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"role": "user"}], "input[0].content"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input[0].content[0]"),  # noqa: E501
    ],
)  # fmt: skip
def test_items_that_are_not_text_messages_are_refused_by_name(items, field):
    with pytest.raises(RequestError) as refused:
        input_messages(ResponsesRequest.model_validate({"input": items}), [])
    assert str(refused.value).startswith(f"{field}: ")
