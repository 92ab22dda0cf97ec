"""GrammarSpec: what a constrained request's output must match (structured output), and the
checks that need no compiler.

No torch import here (xgrammar imports torch): the router checks a spec's shape at the edge
(JSON that parses, a non-empty choice list, keywords a strict schema may use), and the worker
compiles it (pdserve/engine/decoding/grammar.py); a spec that does not compile is a `GrammarError`,
which the router answers with INVALID_ARGUMENT like any other bad field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# json_object: any JSON object; json_schema: JSON text of a schema; regex; choice: one of a
# list of strings; ebnf: xgrammar's EBNF (GBNF) with a `root` rule.
KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf")

MAX_SPEC_CHARS = 64 << 10  # a schema, regex or grammar (the request body caps it too)
MAX_CHOICES = 1024

# JSON Schema keywords the compiler turns into grammar (xgrammar's converter). It ignores the
# others; a strict schema must not rely on an ignored keyword, so strict refuses them, as
# OpenAI's strict mode does.
SUPPORTED_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
        "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minProperties",
        "maxProperties", "propertyNames", "patternProperties", "unevaluatedProperties",
        "unevaluatedItems", "additionalItems", "title", "description", "default", "examples",
        "$schema", "$id", "$comment", "nullable", "multipleOf", "uniqueItems", "contentEncoding",
        "contentMediaType", "deprecated", "readOnly", "writeOnly",
    }
)  # fmt: skip
# Keywords whose value is a name -> subschema map, or a list of subschemas (walked for more).
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)


class GrammarError(ValueError):
    """A grammar spec that cannot constrain decoding; the message says why (the client's
    error: INVALID_ARGUMENT / HTTP 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    """Frozen: the compiled grammar is cached by spec (a second request with the same schema
    compiles nothing). `text` is the schema (JSON), regex or EBNF; `choices` the choice list."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = False

    def __post_init__(self) -> None:
        """Raises GrammarError naming what is wrong."""
        if self.kind not in KINDS:
            raise GrammarError(f"grammar: kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.text) > MAX_SPEC_CHARS:
            raise GrammarError(f"grammar: longer than {MAX_SPEC_CHARS} characters")
        if self.kind == "json_schema":
            self.schema()  # parses, and is strict if asked
        elif self.kind in ("regex", "ebnf") and not self.text:
            raise GrammarError(f"grammar: the {self.kind} is empty")
        elif self.kind == "choice":
            if not self.choices:
                raise GrammarError("grammar: the choice list is empty")
            if len(self.choices) > MAX_CHOICES:
                raise GrammarError(f"grammar: more than {MAX_CHOICES} choices")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise GrammarError("grammar: every choice must be a non-empty string")

    def schema(self) -> dict:
        """The parsed JSON schema (json_schema only)."""
        try:
            schema = json.loads(self.text)
        except ValueError as e:
            raise GrammarError(f"grammar: the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError("grammar: the JSON schema must be a JSON object")
        if self.strict:
            unsupported = sorted(unsupported_keywords(schema))
            if unsupported:
                raise GrammarError(
                    f"grammar: strict schema uses unsupported keyword(s) {unsupported}"
                )
        return schema


def unsupported_keywords(schema: object) -> set[str]:
    """The keywords of `schema` and its subschemas that the compiler would ignore."""
    found: set[str] = set()
    if not isinstance(schema, dict):
        return found
    found |= {k for k in schema if k not in SUPPORTED_KEYWORDS}
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                found |= unsupported_keywords(sub)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                found |= unsupported_keywords(sub)
    for key in _SCHEMA_VALUES:
        found |= unsupported_keywords(schema.get(key))
    return found
