"""Tools through the three families' chat templates: rendered exactly as transformers'
`apply_chat_template(..., tools=...)` renders them, the family recognised from the template,
and each family's own call syntax parsed back into the calls it encodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.models.tokenizer_builder import CHAT_TEMPLATE, write_tokenizer
from pdserve.models.tool_chat_templates import TEMPLATES, use_chat_template
from router.http.chat_template import ChatTemplate
from router.http.tool_messages import with_tool_calls_for_template
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
