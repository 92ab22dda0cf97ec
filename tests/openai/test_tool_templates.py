"""Tools through the three families' chat templates: rendered exactly as transformers'
`apply_chat_template(..., tools=...)` renders them, the family recognised from the template,
each family's own call syntax parsed back into the calls it encodes, and a stream of any
output, in pieces of any size, adding up to the message the whole output makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.messages import TokenBatch
from pdserve.models.tokenizer_builder import CHAT_TEMPLATE, write_tokenizer
from pdserve.models.tool_chat_templates import TEMPLATES, use_chat_template
from router.http.chat_template import ChatTemplate
from router.http.tool_messages import with_tool_calls_for_template
from router.http.tool_output import ToolOutput
from router.http.tool_parsers import PARSERS, parser_for_template
from router.validation import RequestError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL_ID = "abc123XYZ"  # 9 alphanumerics: Mistral's template requires it
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 21}'},
]


def _model_dir(tmp_path: Path, family: str) -> Path:
    write_tokenizer(tmp_path, 512)
    use_chat_template(tmp_path, family)
    return tmp_path


@pytest.mark.parametrize("family", sorted(TEMPLATES))
@pytest.mark.parametrize("turns", [1, 3], ids=["question", "round-trip"])
def test_tools_render_as_transformers_renders_them(tmp_path, family, turns) -> None:
    from transformers import AutoTokenizer

    directory = _model_dir(tmp_path, family)
    messages = with_tool_calls_for_template(ROUND_TRIP[:turns])
    if turns == 3 and family == "mistral":
        messages.append({"role": "user", "content": "And tomorrow?"})
    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    text = ChatTemplate.from_dir(directory).render(messages, tools=TOOLS)
    assert text == expected
    assert "The weather in a city" in text
    if turns == 3:  # the call and its result are in the prompt
        assert '"Paris"' in text and "temp" in text


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_the_family_is_recognised_from_the_template(family) -> None:
    assert parser_for_template(TEMPLATES[family]).family == family
    assert parser_for_template(CHAT_TEMPLATE).family == "hermes"  # the default


@pytest.mark.parametrize(
    "family, output, content",
    [
        ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>', "Let me look.\n"),  # noqa: E501
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\", \\"days\\": 3}"}', ""),  # noqa: E501
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]', ""),  # noqa: E501
        ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]', " "),  # noqa: E501
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}', ""),  # noqa: E501
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}};{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}', ""),  # noqa: E501
    ],
)  # fmt: skip
def test_each_family_parses_its_calls(family, output, content) -> None:
    parser = PARSERS[family]
    text, calls = parser.split(output)
    assert text == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome", "days": 3}),
    ]
    assert len({c.id for c in calls}) == 2
    if family == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    # A stream holds back nothing of the content and everything from the first call on.
    for end in range(len(output) + 1):
        assert parser.held_from(output[:end]) <= len(content)


@pytest.mark.parametrize("family", sorted(TEMPLATES))
@pytest.mark.parametrize(
    "output",
    ["The weather is fine.", '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>'],
)
def test_words_and_broken_calls_are_content(family, output) -> None:
    parser = PARSERS[family]
    assert parser.split(output) == (output, [])
    if family != "hermes" or "<tool_call>" not in output:
        assert parser.held_from(output) == len(output)


@pytest.mark.parametrize(
    "messages, problem",
    [
        ([{"role": "tool", "content": "x"}], r"messages\[0\].tool_call_id: required"),
        ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], "answers no tool call"),
        ([{"role": "user", "tool_calls": []}], "only assistant messages make tool calls"),
        ([{"role": "assistant", "tool_calls": "x"}], "a non-empty list is required"),
        ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{oops"}}]}], r"tool_calls\[0\].function.arguments: not valid JSON"),  # noqa: E501
        ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}], r"tool_calls\[0\].function.name"),  # noqa: E501
    ],
)  # fmt: skip
def test_bad_tool_messages_name_the_field(messages, problem) -> None:
    with pytest.raises(RequestError, match=problem):
        with_tool_calls_for_template(messages)


STREAMED = [
    ("hermes", False, "Let me see.\n<tool_call>\n" + '{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'),  # noqa: E501
    ("hermes", False, 'Half a call <tool_call>{"name": "a", "argum'),
    ("hermes", False, "<tool_call>{\"name\": \"a\"}</tool_call><tool_call>oops</tool_call>"),
    ("hermes", False, "a < b and <tool_c is not a call"),
    ("mistral", False, 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, 2]}}, {"name": "b", "arguments": {"y": "]}"}}]'),  # noqa: E501
    ("mistral", False, '[{"name": "a", "arguments": {"x": 1}}]'),
    ("mistral", False, "[1, 2, 3] is a list"),
    ("llama3", False, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'),  # noqa: E501
    ("llama3", False, "{not json at all"),
    ("llama3", False, "Words, then {braces}."),
    ("hermes", True, '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"s": "}, {"}}]'),  # noqa: E501
    ("hermes", True, '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "argu'),
    ("mistral", True, '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"s": "{cut'),
    ("llama3", True, '[{"name": "a\\"b", "arguments": {"list": [1, {"y": "\\"}"}]}}]'),
]  # fmt: skip


@pytest.mark.parametrize("family, forced, output", STREAMED)
@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_stream_adds_up_to_the_message(family, forced, output, piece, reason) -> None:
    sent_before_the_end = _check_stream(family, forced, output, [piece], reason)
    calls = _message(family, forced, output, reason)[0].get("tool_calls", [])
    if piece == 1 and len(calls) > 1:  # the first call went before the output ended
        assert sent_before_the_end >= 1


# Pieces of calls, markers and words, joined at random: well-formed calls, broken ones, and
# everything between.
FRAGMENTS = [
    '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>', '{"name": "b", "parameters": {}}',
    '[TOOL_CALLS] [{"name": "a", "arguments": {}}]', '[{"name": "a", "arguments": {"x": 1}}',
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name": "a", "arguments": ',
    '{"name": "b", "parameters": ', '{"x": [1, "}"]}', "{", "}", "[", "]", ", ", "; ", " ", "\n",
    "words", '"', "\\", "<", "tool", "_call>",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    family=st.sampled_from(sorted(PARSERS)),
    forced=st.booleans(),
    fragments=st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=14),
    pieces=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    reason=st.sampled_from(["stop", "length"]),
)
def test_any_output_streams_as_its_message(family, forced, fragments, pieces, reason) -> None:
    _check_stream(family, forced, "".join(fragments), pieces, reason)


def _message(family: str, forced: bool, output: str, reason: str) -> tuple[dict, str | None]:
    return ToolOutput(PARSERS[family], forced).message(output, reason)


def _check_stream(family: str, forced: bool, output: str, pieces: list[int], reason: str) -> int:
    """Streams `output` in pieces of these sizes (in turn) and checks that the deltas add up to
    its message; returns how many calls were sent before the last piece."""
    expected, expected_reason = _message(family, forced, output, reason)
    tools = ToolOutput(PARSERS[family], forced)
    content, calls, reasons, sent_before_the_end = "", [], [], 0
    ends = [0]
    while ends[-1] < len(output) or len(ends) == 1:  # an empty output is one empty batch
        ends.append(min(len(output), ends[-1] + pieces[len(ends) % len(pieces)]))
    for i, (start, end) in enumerate(zip(ends, ends[1:], strict=False)):
        last = end == len(output)
        batch = TokenBatch("r", [], [], output[start:end], last, reason if last else None)
        delta, finish_reason = tools.delta(0, output[:end], batch, first=i == 0)
        assert ("role" in delta) == (i == 0)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a new call: its index comes next, with its name
                assert call["index"] == len(calls) and call["function"]["name"]
                calls.append(dict(call["function"]))
                sent_before_the_end += not last
            else:  # more of a call's arguments
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
        reasons.append(finish_reason)
    assert content == (expected["content"] or "")
    expected_calls = expected.get("tool_calls", [])
    assert calls == [c["function"] for c in expected_calls]
    assert reasons == [None] * (len(reasons) - 1) + [expected_reason]
    assert expected_reason == ("tool_calls" if expected_calls and reason == "stop" else reason)
    return sent_before_the_end
