"""Hypothesis strategies from a JSON schema: the subset pydantic writes for request models.

(hypothesis-jsonschema would do this, but its releases lag behind Hypothesis's internals: 0.23
fails on the Hypothesis this project pins.) Supported: `type` (one or a list), `anyOf`/`oneOf`,
`$ref` into the schema's own `$defs`, `const`, `enum`, integer and number bounds, string
lengths, array items and sizes, object `properties` / `required` / `additionalProperties` /
`maxProperties`. Up to four optional properties are drawn at a time; anything else in a schema
(`title`, `default`, `description`) does not constrain values.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_ANY_SCALAR = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()


def from_schema(schema: dict) -> st.SearchStrategy[Any]:
    return _strategy(schema, schema.get("$defs", {}))


def _strategy(node: dict, defs: dict) -> st.SearchStrategy[Any]:
    if "$ref" in node:
        return _strategy(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    for union in ("anyOf", "oneOf"):
        if union in node:
            return st.one_of([_strategy(option, defs) for option in node[union]])
    kind = node.get("type")
    if isinstance(kind, list):
        return st.one_of([_strategy({**node, "type": k}, defs) for k in kind])
    if kind is None:
        return st.recursive(_ANY_SCALAR, lambda inner: st.lists(inner, max_size=3), max_leaves=4)
    return _TYPES[kind](node, defs)


def _integer(node: dict, defs: dict) -> st.SearchStrategy[int]:
    return st.integers(node.get("minimum"), node.get("maximum"))


def _number(node: dict, defs: dict) -> st.SearchStrategy[float]:
    return st.floats(
        node.get("minimum"), node.get("maximum"), allow_nan=False, allow_infinity=False
    )


def _string(node: dict, defs: dict) -> st.SearchStrategy[str]:
    # Text as JSON carries it: no lone surrogates (the mutations add those on purpose).
    return st.text(
        st.characters(exclude_categories=("Cs",)),
        min_size=node.get("minLength", 0),
        max_size=node.get("maxLength"),
    )


def _array(node: dict, defs: dict) -> st.SearchStrategy[list]:
    items = _strategy(node.get("items", {}), defs)
    return st.lists(items, min_size=node.get("minItems", 0), max_size=node.get("maxItems"))


def _object(node: dict, defs: dict) -> st.SearchStrategy[dict]:
    properties = node.get("properties", {})
    if not properties:
        extra = node.get("additionalProperties", True)
        values = _strategy(extra, defs) if isinstance(extra, dict) else _ANY_SCALAR
        return st.dictionaries(st.text(max_size=8), values, max_size=node.get("maxProperties", 3))
    required = set(node.get("required", ()))
    fields = {name: _strategy(schema, defs) for name, schema in properties.items()}
    # A few optional properties at a time: each case then tests a few things, not all at once.
    others = sorted(fields.keys() - required)
    optional = st.lists(st.sampled_from(others), max_size=4, unique=True) if others else st.just([])

    @st.composite
    def objects(draw) -> dict:
        chosen = sorted(required) + draw(optional)
        return {name: draw(fields[name]) for name in chosen}

    return objects()


_TYPES = {
    "integer": _integer,
    "number": _number,
    "string": _string,
    "boolean": lambda node, defs: st.booleans(),
    "null": lambda node, defs: st.none(),
    "array": _array,
    "object": _object,
}
