"""Hypothesis strategies for the OpenAI HTTP API's request bodies: drawn from the schema the
app documents (`app.openapi()`), and deliberately malformed mutations of them.

The documented schema allows values that make a case slow and teach nothing new (4,000 tokens
of output, 64 choices, megabytes of text), so `cheap` narrows it: the model is the served
one, max_tokens is small and required, strings and lists are short, chat messages are turns
the template renders (a known role, text content). Everything else (wrong
signs, unsupported options, ids past the vocabulary) is drawn as the schema allows; the
mutations then break the body on purpose: a field's type, an out-of-range number, a lone
surrogate, a huge value, an unknown field, a missing required field, something that is not a
JSON object, or bytes that are not JSON at all; or the body is sent without the API key, or
with another method than POST.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from hypothesis import strategies as st

from tests.fuzz.json_schema import from_schema

SHORT_TEXT = 24
SHORT_LIST = 4
_SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800"]
# Values of every JSON type, and numbers no field can take.
_WRONG_VALUES = [
    True,
    False,
    None,
    "8",
    "",
    1.5,
    -1,
    0,
    [],
    [True, False],
    {},
    {"a": 1},
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    1e308,
    -1e308,
    5e-324,
]


@dataclass(frozen=True)
class Case:
    """A body to send: `data` as bytes, with `method`, with the API key or a wrong one; `kind`
    says what the answer must be beyond the rules every answer follows (a documented status,
    never 500): "drawn" (no more), "surrogate" (400, the text is not Unicode), "not_json" /
    "not_object" (400), "unauthorized" (401), "wrong_method" (405)."""

    data: bytes
    kind: str
    method: str = "POST"
    authorized: bool = True


def cheap(schema: dict, model: str, vocab_size: int, max_tokens_fields: tuple[str, ...]) -> dict:
    """`schema` narrowed to cases that are quick to serve (see the module's docstring)."""
    schema = copy.deepcopy(schema)
    _shorten(schema)
    props = schema["properties"]
    props["model"] = {"const": model}
    for name in max_tokens_fields:
        props[name] = {"type": "integer", "minimum": -1, "maximum": 4}
    schema["required"] = sorted({*schema.get("required", ()), "model", max_tokens_fields[0]})
    props["n"] = {"type": "integer", "minimum": 0, "maximum": 3}
    props["beam_width"] = {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "null"}]
    }
    ids = {"type": "integer", "minimum": 0, "maximum": vocab_size + 2}
    if "prompt" in props:
        props["prompt"] = {
            "anyOf": [
                {"type": "string", "maxLength": SHORT_TEXT},
                {
                    "type": "array",
                    "items": {"type": "string", "maxLength": SHORT_TEXT},
                    "maxItems": 3,
                },
                {"type": "array", "items": ids, "maxItems": 40},
                {
                    "type": "array",
                    "items": {"type": "array", "items": ids, "maxItems": 20},
                    "maxItems": 3,
                },
            ]
        }
    defs = schema.get("$defs", {})
    if "ChatMessage" in defs:  # turns the template renders: a role it knows, some content
        message = defs["ChatMessage"]
        message["properties"]["role"] = {"enum": ["system", "user", "assistant"]}
        content = message["properties"]["content"]
        content["anyOf"] = [o for o in content["anyOf"] if o.get("type") != "null"]
        message["required"] = ["content", "role"]
        part = defs["ContentPart"]
        part["properties"]["type"] = {"const": "text"}
        part["properties"]["text"] = {"type": "string", "maxLength": SHORT_TEXT}
        part["required"] = ["text", "type"]
    if "stop_token_ids" in props:
        props["stop_token_ids"] = {
            "anyOf": [{"type": "array", "items": ids, "maxItems": SHORT_LIST}, {"type": "null"}]
        }
    return schema


def _shorten(node: object) -> None:
    """Every string and list of the schema kept short, however deep."""
    if isinstance(node, dict):
        if node.get("type") == "string":
            node.setdefault("maxLength", SHORT_TEXT)
        if node.get("type") == "array":
            node["maxItems"] = min(node.get("maxItems", SHORT_LIST), SHORT_LIST)
        if node.get("type") == "object" and "properties" not in node:
            node.setdefault("maxProperties", 3)
        for value in node.values():
            _shorten(value)
    elif isinstance(node, list):
        for item in node:
            _shorten(item)


def drawn(schema: dict) -> st.SearchStrategy[Case]:
    return from_schema(schema).map(lambda body: Case(_encode(body), "drawn"))


def mutated(schema: dict) -> st.SearchStrategy[Case]:
    bodies = from_schema(schema)
    fields = sorted(schema["properties"])
    required = sorted(schema.get("required", ()))
    return st.one_of(
        st.builds(_with, bodies, st.sampled_from(fields), st.sampled_from(_WRONG_VALUES)),
        st.builds(_with, bodies, st.sampled_from(fields), st.floats(allow_nan=False)),
        st.builds(_with, bodies, st.sampled_from(fields), st.integers(-(2**80), 2**80)),
        st.builds(_with_surrogate, bodies, st.sampled_from(fields), st.sampled_from(_SURROGATES)),
        st.builds(_with, bodies, st.sampled_from(fields), _huge_values()),
        st.builds(_with, bodies, st.text(min_size=1, max_size=12), _json_values()),
        st.builds(_without, bodies, st.sampled_from(required)),
        _json_values().map(lambda value: Case(_encode(value), "not_object")),
        _not_json().map(lambda data: Case(data, "not_json")),
        bodies.map(lambda body: Case(_encode(body), "unauthorized", authorized=False)),
        st.builds(
            lambda body, method: Case(_encode(body), "wrong_method", method=method),
            bodies,
            st.sampled_from(["GET", "PUT", "PATCH", "DELETE"]),
        ),
    )


def _with(body: dict, field: str, value: object) -> Case:
    return Case(_encode({**body, field: value}), "drawn")


def _with_surrogate(body: dict, field: str, surrogate: str) -> Case:
    """A lone surrogate in a string where `field` has one (in a list: its first item), else
    as the field's whole value."""
    value = body.get(field)
    if isinstance(value, list) and value and isinstance(value[0], str):
        value = [value[0] + surrogate, *value[1:]]
    elif isinstance(value, list) and value and isinstance(value[0], dict):  # chat messages
        value = [{**value[0], "content": surrogate}, *value[1:]]
    else:
        value = (value if isinstance(value, str) else "") + surrogate
    return Case(_encode({**body, field: value}), "surrogate")


def _without(body: dict, field: str) -> Case:
    return Case(_encode({k: v for k, v in body.items() if k != field}), "drawn")


def _huge_values() -> st.SearchStrategy[object]:
    """Far past every limit, yet under the body cap (413 is tested in tests/openai)."""
    return st.sampled_from(
        [
            "x" * (1 << 21),
            [5] * 100_000,
            ["a"] * 10_000,
            [[5] * 10] * 5_000,
            [{"role": "user", "content": "hi"}] * 2_000,
            10**4000,
            "9" * 5_000,
        ]
    )


def _json_values() -> st.SearchStrategy[object]:
    scalars = (
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=8,
    )


def _not_json() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from(
            [
                b"",
                b"{",
                b'{"model": NaN}',
                b'{"model": Infinity, "prompt": "x"}',
                b"\xff\xfe{}",
                b'{"prompt": "\xc3\x28"}',
                b"{'model': 'x'}",
                b'{"model": "m",}',
                b'{"model": "m", "max_tokens": ' + b"9" * 5_000 + b"}",  # past int() 's digits
                b'{"model": "m", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # deep
            ]
        ),
        st.binary(max_size=64),
    )


def _encode(value: object) -> bytes:
    """JSON as a client writes it: ASCII escapes (the only way to spell a lone surrogate)."""
    return json.dumps(value).encode()
