"""Structured output in the engine: whatever the (random) weights, every output of a
constrained request matches its grammar — greedy, sampled, n choices, after a prefill → decode
handoff and after a retry's continuation — and a schema compiles once per engine."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from pdserve.core.grammar_spec import GrammarError, GrammarSpec
from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts
from tests.engine.test_disaggregation import handoff

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
        },
    },
    "required": ["name", "age", "pet", "tags", "home"],
}
SCHEMA = GrammarSpec("json_schema", json.dumps(PERSON), strict=True)
PROMPTS = random_prompts([7, 11, 5, 9], seed=3)


def text_of(engine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens)


def assert_person(engine, tokens: list[int]) -> None:
    jsonschema.validate(json.loads(text_of(engine, tokens)), PERSON)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=200, grammar=SCHEMA),
        SamplingParams(max_tokens=200, temperature=1.0, seed=5, grammar=SCHEMA),
        SamplingParams(max_tokens=200, temperature=1.0, top_k=20, n=3, seed=9, grammar=SCHEMA),
    ],
    ids=["greedy", "sampled", "n=3"],
)
def test_every_output_is_valid_against_its_schema(make_engine, params):
    engine = make_engine()
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(rid, prompt, params)
    outputs: dict[tuple[str, int], list[int]] = {}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finished:
                reasons[(out.request_id, out.index)] = out.finish_reason
    assert len(outputs) == len(PROMPTS) * params.n
    for key, tokens in outputs.items():
        assert reasons[key] == "stop"
        assert tokens[-1] in engine.eos_token_ids  # EOS only once the object is complete
        assert_person(engine, tokens)
    assert engine.grammars.compiles == 1  # one schema, compiled once for every request


def test_regex_choice_and_ebnf_outputs_match(make_engine):
    engine = make_engine()
    cases = [
        (GrammarSpec("regex", r"[a-c]{2,5}-[0-9]{3}"), r"[a-c]{2,5}-\d{3}"),
        (GrammarSpec("choice", choices=("yes", "no", 'say "hi"')), r'yes|no|say "hi"'),
        (GrammarSpec("ebnf", 'root ::= "(" ("x" | "y")+ ")"'), r"\([xy]+\)"),
    ]
    for spec, pattern in cases:
        params = SamplingParams(max_tokens=300, temperature=1.0, seed=1, grammar=spec)
        for tokens in engine.generate(PROMPTS, params):
            assert re.fullmatch(pattern, text_of(engine, tokens)), (spec.kind, tokens)


def test_json_object_outputs_are_objects(make_engine):
    """Free-form JSON need not end within max_tokens under random weights: the outputs that
    end (the grammar's EOS) are whole objects, the others prefixes of one."""
    engine = make_engine()
    params = SamplingParams(
        max_tokens=120, temperature=1.0, seed=2, grammar=GrammarSpec("json_object")
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and out.finish_reason == "stop":
                assert isinstance(json.loads(text_of(engine, tokens[out.request_id])), dict)
    assert all(text_of(engine, t).startswith("{") for t in tokens.values())


def test_a_handoff_rebuilds_the_grammar_on_the_decode_side(make_engine):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=11, grammar=SCHEMA)
    prompt = random_prompts([30], seed=5)[0]
    [whole] = make_engine().generate([prompt], params)
    got, _ = handoff(make_engine(), make_engine(), "r", prompt, params)
    assert got == whole
    assert_person(make_engine(), got)


@pytest.mark.parametrize("done", [1, 6, 15])
def test_a_retry_continues_the_grammar_from_the_tokens_so_far(make_engine, done):
    """The router's continuation: the prompt carries the tokens generated so far and
    seed_offset counts them; the matcher is fed them, so the rest completes the same object."""
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=21, grammar=SCHEMA)
    prompt = PROMPTS[0]
    [whole] = make_engine().generate([prompt], params)
    rest = dataclasses.replace(params, max_tokens=200 - done, seed_offset=done)
    [tail] = make_engine().generate([prompt + whole[:done]], rest)
    assert whole[:done] + tail == whole
    assert_person(make_engine(), whole[:done] + tail)


def test_a_continuation_whose_tokens_leave_the_grammar_is_refused(make_engine):
    engine = make_engine()
    bad = engine.tokenizer.encode("x", add_special_tokens=False)  # JSON cannot start with x
    params = SamplingParams(max_tokens=20, grammar=SCHEMA, seed_offset=len(bad))
    with pytest.raises(GrammarError, match="do not match"):
        engine.add_request("r", PROMPTS[0] + bad, params)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "spec, problem",
    [
        (GrammarSpec("json_schema", '{"type": "objekt"}'), "objekt"),
        (GrammarSpec("regex", "(?<=a)b"), "Lookbehind"),
        (GrammarSpec("ebnf", "root ::= missing"), "missing"),
    ],
)
def test_a_spec_that_does_not_compile_is_a_grammar_error_naming_the_problem(
    make_engine, spec, problem
):
    with pytest.raises(GrammarError, match=problem):
        make_engine().add_request("r", PROMPTS[0], SamplingParams(grammar=spec))


def test_checks_before_compiling_name_the_problem():
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec("json_schema", "{nope")
    with pytest.raises(GrammarError, match=r"unsupported keyword\(s\) \['if', 'not'\]"):
        GrammarSpec(
            "json_schema", json.dumps({"properties": {"a": {"not": {}}}, "if": {}}), strict=True
        )
    GrammarSpec("json_schema", json.dumps({"if": {}}))  # not strict: ignored, as OpenAI does
    with pytest.raises(GrammarError, match="choice list is empty"):
        GrammarSpec("choice")
