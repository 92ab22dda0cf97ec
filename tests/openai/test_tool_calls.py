"""Tool calls through the official `openai` SDK, on random-weight models with each family's
chat template (Hermes / Qwen disaggregated, Llama 3 and Mistral colocated): a required or named
call always parses and its arguments match the tool's schema (the grammar guarantees it,
whatever the weights); streamed deltas accumulate to the same calls; an `auto` answer is read
for calls in the family's own syntax; a call, its result and the answer make a round trip;
bad tools, choices and messages are 400s that name the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from router.http.tool_request import MAX_FORCED_CALLS
from tests.openai.served import keyed_config, serve

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
CALCULATOR = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99},
        "op": {"enum": ["+", "-", "*"]},
    },
    "required": ["a", "b", "op"],
}
SCHEMAS = {"get_weather": WEATHER, "calculate": CALCULATOR}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
QUESTION = [{"role": "user", "content": "What is the weather in Oslo, and what is 6 * 7?"}]
# What each family's model writes for a call: words first where the family allows, the call.
CALL_TEXT = {
    "hermes": ("Checking.\n", '<tool_call>\n{"name": "calculate", "arguments": {"a": 6, "b": 7, "op": "*"}}\n</tool_call>'),  # noqa: E501
    "mistral": ("Checking. ", '[TOOL_CALLS] [{"name": "calculate", "arguments": {"a": 6, "b": 7, "op": "*"}}]'),  # noqa: E501
    "llama3": ("", '<|python_tag|>{"name": "calculate", "parameters": {"a": 6, "b": 7, "op": "*"}}'),  # noqa: E501
}  # fmt: skip
WORDS = "It is sunny."


@pytest.fixture(
    scope="module",
    params=[("hermes", "always"), ("llama3", "never"), ("mistral", "never")],
    ids=["hermes-disaggregated", "llama3-colocated", "mistral-colocated"],
)
def served(request, ray_cluster, tmp_path_factory):
    family, disaggregate = request.param
    with serve(keyed_config(tmp_path_factory, family, disaggregate=disaggregate)) as app:
        app.family = family
        yield app


def _check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_always_parse_and_match_their_schemas(client, model):
    calls = 0
    for seed in range(4):
        response = client.chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=1.0,
            n=4,
            seed=seed,
        )
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls", choice.message
            assert choice.message.content is None
            _check_calls(choice.message.tool_calls)
            calls += len(choice.message.tool_calls)
    assert calls == 16


def test_parallel_calls_are_several_valid_calls_streamed_as_they_grow(client, model):
    asked = dict(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=700,
        temperature=1.0,
        n=3,
        seed=1,
    )
    response = client.chat.completions.create(**asked)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        _check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) <= MAX_FORCED_CALLS
    assert max(len(c.message.tool_calls) for c in response.choices) > 1
    # Streamed a token an event: each call's name as soon as it is written, then its
    # arguments as they grow, over many chunks.
    streamed: dict[int, dict[int, dict]] = {}
    chunks_with_arguments: dict[int, int] = {}
    stream = client.chat.completions.create(
        **asked, stream=True, stream_options={"one_token_per_event": True}
    )
    for chunk in stream:
        for choice in chunk.choices:
            calls = streamed.setdefault(choice.index, {})
            for delta in choice.delta.tool_calls or []:
                if delta.id:
                    assert delta.index == len(calls) and delta.function.name
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
                more = bool(delta.function.arguments)
                chunks_with_arguments[choice.index] = (
                    chunks_with_arguments.get(choice.index, 0) + more
                )
    for choice in response.choices:
        calls = choice.message.tool_calls
        assert [
            (c["name"], json.loads(c["arguments"])) for c in streamed[choice.index].values()
        ] == [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        assert chunks_with_arguments[choice.index] > 3 * len(calls)


def test_a_named_function_is_the_one_called(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "calculate"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        n=6,
        seed=11,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls, names=("calculate",))


def test_parallel_tool_calls_false_makes_one_call(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        n=6,
        seed=5,
    )
    for choice in response.choices:
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)


def test_streamed_deltas_accumulate_to_the_same_calls(client, model):
    asked = dict(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=9,
    )
    whole = client.chat.completions.create(**asked).choices[0].message
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]
    # The SDK's stream helper accumulates the deltas into the final message.
    # A token an event: batches of several tokens (a loaded machine) would join the pieces.
    one_per_event = {"one_token_per_event": True}
    with client.chat.completions.stream(**asked, stream_options=one_per_event) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion().choices[0]
    # The arguments came in pieces, and each piece was an event of the SDK's.
    assert events.count("tool_calls.function.arguments.delta") > 1
    assert events.count("tool_calls.function.arguments.done") == len(expected)
    assert final.finish_reason == "tool_calls"
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    assert got == expected
    # And the raw chunks, accumulated by index as a client does.
    accumulated: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = accumulated.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert [r for r in reasons if r] == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in accumulated.values()] == expected


@pytest.mark.parametrize("answer", ["call", "words"])
def test_auto_reads_the_familys_own_call_syntax_or_words(client, model, served, answer):
    """The output is steered (guided_choice) to a call in the family's syntax, or to plain
    words; `auto` reads the first as a call, the second as content, streamed or not."""
    words, call = CALL_TEXT[served.family]
    asked = dict(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=200,
        extra_body={"guided_choice": [words + call if answer == "call" else WORDS]},
    )
    choice = client.chat.completions.create(**asked).choices[0]
    if answer == "call":
        assert choice.finish_reason == "tool_calls"
        [made] = choice.message.tool_calls
        assert (made.function.name, json.loads(made.function.arguments)) == (
            "calculate",
            {"a": 6, "b": 7, "op": "*"},
        )
        assert choice.message.content == (words or None)
    else:
        assert choice.finish_reason == "stop"
        assert choice.message.content == WORDS and not choice.message.tool_calls
    content, names, reasons = "", [], []
    for chunk in client.chat.completions.create(**asked, stream=True):
        for streamed in chunk.choices:
            content += streamed.delta.content or ""
            assert "calculate" not in content  # held back, not sent as text
            names += [d.function.name for d in streamed.delta.tool_calls or []]
            reasons.append(streamed.finish_reason)
    assert content == (words if answer == "call" else WORDS)
    assert names == (["calculate"] if answer == "call" else [])
    assert [r for r in reasons if r] == [choice.finish_reason]


def test_a_round_trip_call_result_answer(client, model):
    tools = dict(tools=TOOLS, max_tokens=200, temperature=1.0, seed=4)
    first = client.chat.completions.create(
        model=model, messages=QUESTION, tool_choice="required", parallel_tool_calls=False, **tools
    )
    message = first.choices[0].message
    _check_calls(message.tool_calls)
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 42})}
        for call in message.tool_calls
    ]
    conversation = [*QUESTION, message.model_dump(exclude_none=True), *results]
    second = client.chat.completions.create(model=model, messages=conversation, **tools)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    if answer.finish_reason != "tool_calls":
        assert isinstance(answer.message.content, str)
    # The call and its result are part of the second prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


@pytest.mark.parametrize(
    "asked, problem",
    [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice: no tool named 'nope' in tools"),  # noqa: E501
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "objekt"}}}}}]), r"tools\[0\].function.parameters.properties.x.type: not a valid JSON schema"),  # noqa: E501
        (dict(tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object", "not": {}}}}]), r"tools\[0\].function.parameters: strict schema uses unsupported keyword\(s\) \['not'\]"),  # noqa: E501
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), r"tools\[0\].function.name"),  # noqa: E501
        (dict(tools=TOOLS + TOOLS[:1]), r"tools\[2\].function.name: 'get_weather' is declared twice"),  # noqa: E501
        (dict(tool_choice="required"), "tool_choice: requires tools"),
        (dict(functions=[{"name": "f", "parameters": {}}]), "functions: deprecated by OpenAI and not supported; send tools"),  # noqa: E501
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice: must be"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format: conflicts with tool_choice"),  # noqa: E501
        (dict(messages=[*QUESTION, {"role": "tool", "tool_call_id": "abc123XYZ", "content": "1"}]), r"messages\[1\].tool_call_id: 'abc123XYZ' answers no tool call"),  # noqa: E501
        (dict(messages=[*QUESTION, {"role": "assistant", "tool_calls": [{"id": "abc123XYZ", "type": "function", "function": {"name": "calculate", "arguments": "{6*7"}}]}]), r"messages\[1\].tool_calls\[0\].function.arguments: not valid JSON"),  # noqa: E501
    ],
)  # fmt: skip
def test_bad_tools_choices_and_messages_are_400s_naming_the_problem(client, model, asked, problem):
    asked = {"messages": QUESTION, "max_tokens": 5, **asked}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, **asked)
    error = caught.value.body
    assert re.search(problem, error["message"]), error["message"]
    assert error["param"] and error["message"].startswith(error["param"] + ": ")  # the field
    # The server keeps serving.
    ok = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=5, tools=TOOLS, tool_choice="none"
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert not ok.choices[0].message.tool_calls
