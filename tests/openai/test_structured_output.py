"""Structured output through the official `openai` SDK, colocated and disaggregated: random
weights, yet every output is valid against its JSON schema (the grammar guarantees it),
regex and choice outputs match, beam search's beams match, and a bad grammar is a 400 that names the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.openai.served import keyed_config, serve

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": ["low", "mid", "high"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["ok", "level", "count"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "role": {"enum": ["admin", "guest"]},
                },
                "required": ["name", "role"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "array": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 4,
            },
            "label": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
        },
        "required": ["scores", "label"],
    },
    "refs": {
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}},  # noqa: E501
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]}},  # noqa: E501
        "required": ["a", "b"],
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=["always", "never"], ids=["disaggregated", "colocated"])
def served(request, ray_cluster, tmp_path_factory):
    with serve(keyed_config(tmp_path_factory, disaggregate=request.param)) as app:
        yield app


def test_a_hundred_sampled_outputs_are_all_valid_against_their_schemas(client, model):
    valid = 0
    for name, schema in SCHEMAS.items():
        response = client.completions.create(
            model=model,
            prompt=f"Give me {name} JSON:",
            max_tokens=150,
            temperature=1.0,
            n=25,
            seed=len(name),
            extra_body={"response_format": _json_schema(name, schema)},
        )
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), schema)
            valid += 1
    assert valid == 100


def test_chat_with_a_json_schema_response_format(client, model):
    schema = SCHEMAS["nested"]
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Who is logged in?"}],
        max_tokens=150,
        temperature=1.0,
        seed=3,
        response_format=_json_schema("nested", schema),
    )
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_json_object_starts_an_object(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=40,
        response_format={"type": "json_object"},
    )
    assert response.choices[0].message.content.startswith("{")


def test_guided_regex_choice_and_grammar_outputs_match(client, model):
    cases = [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"}, r"[0-9]{3}-[a-z]{2,4}"),
        ({"guided_choice": ["red", "green", "blue"]}, r"red|green|blue"),
        ({"guided_grammar": 'root ::= "<" ("ab" | "c")+ ">"'}, r"<(ab|c)+>"),
    ]
    for extra, pattern in cases:
        response = client.completions.create(
            model=model, prompt="Answer:", max_tokens=200, temperature=1.0, n=8, extra_body=extra
        )
        for choice in response.choices:
            assert re.fullmatch(pattern, choice.text), (extra, choice.text)


def test_beam_search_under_a_grammar_returns_beams_that_match_it(client, model):
    response = client.completions.create(
        model=model,
        prompt="Pick a colour:",
        max_tokens=20,
        temperature=0.0,
        n=2,
        extra_body={"beam_width": 3, "guided_choice": ["red", "green", "blue"]},
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.text
        assert re.fullmatch(r"red|green|blue", choice.text), choice.text


@pytest.mark.parametrize(
    "extra, problem",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},  # noqa: E501
            'Unsupported type "objekt"',
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"type": "object", "not": {}}}}},  # noqa: E501
            r"response_format: strict schema uses unsupported keyword\(s\) \['not'\]",
        ),
        ({"guided_regex": "(?=a)b"}, "Lookahead is not supported"),
        ({"guided_grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ({"guided_choice": []}, "guided_choice: the choice list is empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice: conflicts with guided_regex"),
        ({"response_format": {"type": "yaml"}}, "response_format: type must be"),
    ],
)  # fmt: skip
def test_a_bad_grammar_is_a_400_naming_the_problem(client, model, extra, problem):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="x", max_tokens=5, extra_body=extra)
    assert re.search(problem, caught.value.body["message"]), caught.value.body["message"]
    # The server keeps serving.
    ok = client.completions.create(
        model=model, prompt="x", max_tokens=5, extra_body={"guided_choice": ["fine"]}
    )
    assert ok.choices[0].text == "fine"


def _json_schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
