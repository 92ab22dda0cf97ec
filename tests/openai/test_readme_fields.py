"""The README's table of request fields names exactly the fields the HTTP API accepts
(router/http/schemas.py; the Responses API's, router/http/response_schemas.py, in a table of
its own): a field added to the API without a line in the README, or a README line for a field
the API does not take, fails here."""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin

from router.http.response_schemas import ResponsesRequest
from router.http.schemas import ChatCompletionRequest, CompletionRequest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_fields(header: str = "field") -> set[str]:
    """The backquoted names in the first column of the README's `| <header> | what |` table."""
    text = README.read_text()
    table = re.search(rf"^\| {header} \| what \|\n\|---\|---\|\n((?:\|.*\n)+)", text, re.M)
    assert table, f"README.md has no `| {header} | what |` table"
    names = set()
    for row in table.group(1).splitlines():
        first_column = row.split("|")[1]
        names |= set(re.findall(r"`([^`]+)`", first_column))
    return names


def schema_fields(model: type, prefix: str = "") -> set[str]:
    """Every field a body may carry; an options object (`stream_options`) by its members."""
    names = set()
    for name, field in model.model_fields.items():
        options = _options_model(field.annotation)
        if options is None:
            names.add(prefix + name)
        else:
            names |= schema_fields(options, f"{prefix}{name}.")
    return names


def _options_model(annotation: object) -> type | None:
    """The model of a field that is one object (or null); None for anything else."""
    is_union = get_origin(annotation) in (Union, UnionType)
    for member in get_args(annotation) if is_union else (annotation,):
        if isinstance(member, type) and hasattr(member, "model_fields"):  # a pydantic model
            return member
    return None


def accepted_fields() -> set[str]:
    return schema_fields(CompletionRequest) | schema_fields(ChatCompletionRequest)


def test_the_readme_lists_every_field_the_http_api_accepts() -> None:
    missing = accepted_fields() - readme_fields()
    assert not missing, f"accepted by the HTTP API but not in the README's table: {sorted(missing)}"


def test_the_readme_lists_no_field_the_http_api_does_not_accept() -> None:
    unknown = readme_fields() - accepted_fields()
    assert not unknown, f"in the README's table but not accepted: {sorted(unknown)}"


def test_the_readme_lists_exactly_the_responses_fields() -> None:
    assert readme_fields("Responses field") == schema_fields(ResponsesRequest)
