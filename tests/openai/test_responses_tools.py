"""Function tools on `/v1/responses` through the official `openai` SDK against a served system
(real Ray workers, the router's HTTP API and Redis; a random-weight model with the Hermes chat
template): required and named calls are `function_call` items that parse and match their
schemas (the grammar guarantees it, whatever the weights); a stream's events accumulate to the
same items; a call, its output and the answer make a round trip, continued with
`previous_response_id` or given back as input items; bad tools and outputs are 400s naming the
problem."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.openai.served import keyed_config, serve
from tests.openai.test_tool_calls import SCHEMAS  # the same two functions as chat's tools

# The Responses API's flat tools.
TOOLS = [
    {"type": "function", "name": name, "description": f"{name} tool", "parameters": schema}
    for name, schema in SCHEMAS.items()
]
QUESTION = "What is the weather in Oslo, and what is 6 * 7?"
ONE_CALL = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    config = keyed_config(
        tmp_path_factory, "hermes", prefill_workers=0, decode_workers=1, disaggregate="never"
    )
    with serve(config) as app:
        yield app


def _calls(response) -> list:
    """The response's function_call items, checked against their tools' schemas."""
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert call.status == "completed" and call.name in SCHEMAS
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def _items(response) -> list[tuple]:
    return [
        (item.type, item.name, json.loads(item.arguments))
        if item.type == "function_call"
        else (item.type, item.content[0].text)
        for item in response.output
    ]


def test_required_and_named_calls_are_function_call_items_matching_their_schemas(client):
    for seed in range(4):
        response = client.responses.create(
            input=QUESTION,
            **ONE_CALL,
            max_output_tokens=200,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        assert response.status == "completed"
        [call] = response.output  # the call only: no message item
        _calls(response)
        assert response.tools[0].name == "get_weather" and response.tool_choice == "required"
        # Stored as answered.
        assert client.responses.retrieve(response.id).output[0].call_id == call.call_id
    named = client.responses.create(
        input=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "calculate"},
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 1},
    )
    assert {call.name for call in _calls(named)} == {"calculate"}


def test_parallel_calls_are_several_items_streamed_as_the_same(client, model):
    counts = []
    for seed in range(1, 4):
        asked = dict(
            model=model,
            input=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            max_output_tokens=700,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        response = client.responses.create(**asked)
        assert response.status == "completed"
        calls = _calls(response)
        assert len({c.call_id for c in calls}) == len({c.id for c in calls}) == len(calls)
        counts.append(len(calls))
        with client.responses.stream(**asked) as stream:
            added = [e.output_index for e in stream if e.type == "response.output_item.added"]
            assert _items(stream.get_final_response()) == _items(response)
        assert added == list(range(len(calls)))
    assert max(counts) > 1


def test_streamed_events_accumulate_to_the_same_items(client, model):
    asked = dict(
        model=model,
        input=QUESTION,
        **ONE_CALL,
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 9},
    )
    whole = client.responses.create(**asked)
    expected = _items(whole)
    # The SDK's stream helper accumulates the events into the final response.
    with client.responses.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert _items(final) == expected
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds.count("response.function_call_arguments.delta") >= 1
    assert kinds.count("response.function_call_arguments.done") == len(expected)
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    # And the raw events: numbered in order, the deltas joining to the done arguments.
    arguments: dict[str, str] = {}
    done: dict[str, str] = {}
    for number, event in enumerate(client.responses.create(**asked, stream=True)):
        assert event.sequence_number == number
        if event.type == "response.output_item.added":
            assert event.item.type == "function_call" and event.item.arguments == ""
            arguments[event.item.id] = ""
        elif event.type == "response.function_call_arguments.delta":
            arguments[event.item_id] += event.delta
        elif event.type == "response.function_call_arguments.done":
            done[event.item_id] = event.arguments
        elif event.type == "response.completed":
            assert _items(event.response) == expected
            ids = [item.id for item in event.response.output]
    assert arguments == done and list(done) == ids
    # The streamed response was stored with the calls it streamed: their outputs continue it.
    outputs = [
        {"type": "function_call_output", "call_id": item.call_id, "output": "1"}
        for item in final.output
    ]
    after = client.responses.create(
        input=outputs, previous_response_id=final.id, max_output_tokens=2, tools=TOOLS
    )
    assert after.usage.input_tokens > final.usage.input_tokens


def test_a_round_trip_continued_with_previous_response_id(client):
    first = client.responses.create(
        input=QUESTION, **ONE_CALL, max_output_tokens=200, temperature=1.0, extra_body={"seed": 4}
    )
    [call] = _calls(first)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"r": 42}'}
    second = client.responses.create(
        input=[output],
        previous_response_id=first.id,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    [message] = second.output
    assert message.type == "message" and second.output_text == message.content[0].text
    # The call and its output are in the second prompt, which starts with the first's tokens.
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    assert second.usage.input_tokens_details.cached_tokens > 0
    # Tools are this turn's, as instructions are (OpenAI carries neither over).
    third = client.responses.create(
        input="Thanks.",
        previous_response_id=second.id,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert third.usage.input_tokens > second.usage.input_tokens
    assert third.usage.input_tokens_details.cached_tokens > second.usage.input_tokens // 2
    # The same conversation given back as input items, without the store, is the same prompt.
    again = client.responses.create(
        input=[
            {"role": "user", "content": QUESTION},
            *first.output,  # the output items given back as they came (the SDK way)
            output,
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
        store=False,
    )
    assert again.usage.input_tokens == second.usage.input_tokens
    assert again.output_text == second.output_text


@pytest.mark.parametrize(
    "asked, problem",
    [
        (dict(tools=[{"type": "web_search"}]), r"tools\[0\]\.type: 'web_search' tools are not supported"),  # noqa: E501
        (dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice: no tool named 'nope' in tools"),  # noqa: E501
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice: must be"),
        (dict(tool_choice="required"), "tool_choice: requires tools"),
        (dict(tools=[{"type": "function", "name": "bad name"}]), r"tools\[0\]\.name: 1 to 64"),
        (dict(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "objekt"}}}}]), r"tools\[0\]\.parameters\.properties\.x\.type: not a valid JSON schema"),  # noqa: E501
        (dict(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}]), r"tools\[0\]\.parameters\.properties\.x\.pattern: not a valid JSON schema"),  # noqa: E501
        (dict(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}], tool_choice="required"), r"^tools: "),  # noqa: E501
        (dict(tools=[*TOOLS, TOOLS[0]]), r"tools\[2\]\.name: 'get_weather' is declared twice"),
        (dict(**ONE_CALL, text={"format": {"type": "json_object"}}), "text.format: conflicts with tool_choice"),  # noqa: E501
        (dict(input=[{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "1"}]), r"input\[1\]\.call_id: 'call_x' answers no earlier function_call"),  # noqa: E501
        (dict(input=[{"type": "function_call", "call_id": "c", "name": "calculate", "arguments": "{6*7"}]), r"input\[0\]\.arguments: not valid JSON"),  # noqa: E501
    ],
)  # fmt: skip
def test_bad_tools_and_items_are_400s_naming_the_problem(client, asked, problem):
    asked = {"input": QUESTION, "max_output_tokens": 5, **asked}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**asked)
    error = caught.value.body
    assert re.search(problem, error["message"]), error["message"]
    assert error["param"] and error["message"].startswith(error["param"] + ": ")
    # The server keeps serving.
    ok = client.responses.create(input=QUESTION, max_output_tokens=4, tools=TOOLS)
    assert ok.status in ("completed", "incomplete")
