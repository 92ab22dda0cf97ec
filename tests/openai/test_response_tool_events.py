"""A Responses stream with tools, read by the official SDK's own accumulator: whatever the
output (words, calls in each family's syntax, words then calls, forced calls, a call cut short)
and however the text is split into batches, the items the events build are the items of the
non-streamed response, the final event names the items the stream added, and the events are
numbered in order. The served path (router/http/responses.py) runs the same code
(tests/openai/test_responses_tools.py); these outputs cannot be steered there, the model's
weights being random."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from pdserve.core.messages import TokenBatch
from router.http.choices import Choice, Progress
from router.http.response_events import EventStream, ResponseShape
from router.http.response_schemas import ResponsesRequest
from router.http.response_tools import ResponseTools
from router.http.tool_output import ToolOutput
from router.http.tool_parsers import PARSERS

CALL = '{"name": "calculate", "arguments": {"a": 6, "b": 7, "op": "*"}}'
OTHER = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
OUTPUTS = {
    "hermes": [
        "It is sunny.",
        f"Checking.\n<tool_call>\n{CALL}\n</tool_call>",
        f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{OTHER}\n</tool_call>",
        f"  \n<tool_call>\n{CALL}\n</tool_call>",
        "",
    ],
    "mistral": ["Fine.", f"Checking. [TOOL_CALLS] [{CALL}, {OTHER}]", f"[TOOL_CALLS] [{CALL}]"],
    "llama3": ["Fine.", f"<|python_tag|>{CALL.replace('arguments', 'parameters')}"],
}
CASES = [(family, output, False) for family, outputs in OUTPUTS.items() for output in outputs]
CASES += [("hermes", f"[{CALL}, {OTHER}]", True), ("hermes", f"[{CALL}]", True)]


def _shape(family: str, forced: bool) -> ResponseShape:
    return ResponseShape(
        id="resp_1",
        message_id="msg_1",
        model="m",
        body=ResponsesRequest(input="x"),
        text_format={"type": "text"},
        tools=ResponseTools(ToolOutput(PARSERS[family], forced)),
    )


def _choice() -> Choice:
    return Choice(0, [1, 2], Progress(received=0.0, prompt_tokens=2))


def _batches(text: str, size: int, reason: str) -> list[TokenBatch]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    return [
        TokenBatch("r", [1], [0.0], piece, finished=i == len(pieces) - 1, finish_reason=reason)
        for i, piece in enumerate(pieces)
    ]


def _streamed(family: str, forced: bool, text: str, size: int, reason: str = "stop") -> list:
    stream, choice = EventStream(_shape(family, forced)), _choice()
    raw = stream.opening()
    for k, batch in enumerate(_batches(text, size, reason)):
        choice.add(batch)
        raw += stream.step(choice, batch, k == 0)
    raw += stream.closing(choice)
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


def _items(output: list) -> list[tuple]:
    """Items as a client reads them (the ids aside, which differ between two requests)."""
    return [
        (item["type"], item["name"], item["arguments"])
        if item["type"] == "function_call"
        else (item["type"], [part["text"] for part in item["content"]])
        for item in output
    ]


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
@pytest.mark.parametrize("family, text, forced", CASES)
def test_the_sdk_accumulates_the_events_to_the_non_streamed_items(family, text, forced, size):
    choice = _choice()
    for batch in _batches(text, 1000, "stop"):
        choice.add(batch)
    whole = _shape(family, forced).response("completed", choice)
    events = _streamed(family, forced, text, size)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    state: ResponseStreamState = ResponseStreamState(input_tools=[], text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    # What the added items and their deltas built, as the SDK's snapshot holds it.
    snapshot = state._ResponseStreamState__current_snapshot  # type: ignore[attr-defined]
    built = _items([item.to_dict() for item in snapshot.output])
    assert built == _items(whole["output"])
    final = state._completed_response
    assert final is not None and _items([i.to_dict() for i in final.output]) == built
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert [item.id for item in final.output] == added
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == text.count('"name"')  # every call was read as one
    assert all(call.call_id and call.id.startswith("fc_") for call in calls)
    assert len({call.call_id for call in calls}) == len(calls)
    if calls:
        assert "calculate" not in "".join(
            e["delta"] for e in events if e["type"] == "response.output_text.delta"
        )


@pytest.mark.parametrize("size", [1, 5])
def test_a_call_cut_short_ends_the_stream_incomplete_with_the_same_items(size):
    text = '[{"name": "calculate", "arguments": {"a": 6, "b'
    choice = _choice()
    for batch in _batches(text, 1000, "length"):
        choice.add(batch)
    whole = _shape("hermes", True).response("incomplete", choice)
    assert _items(whole["output"]) == [("function_call", "calculate", '{"a": 6, "b')]
    events = _streamed("hermes", True, text, size, "length")
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert _items(last["response"]["output"]) == _items(whole["output"])
    arguments = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert arguments == '{"a": 6, "b'
