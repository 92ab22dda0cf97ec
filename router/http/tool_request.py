"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`: checked (a 400 naming the
field), and for `tool_choice` "required" or a named function, the grammar that forces a call.

The forced calls' grammar is one JSON schema for every template family: an array of
`{"name": <a tool's name>, "arguments": <that tool's parameters>}`, at most one item when
`parallel_tool_calls` is false, else at most MAX_FORCED_CALLS (vLLM forces calls the same way,
without the bound). The grammar decides the output whatever the weights, so the call always
parses and its arguments match the tool's schema; the bound makes it end, too, where a model
would go on adding calls to the list until it runs out of tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from pdserve.core.grammar_spec import GrammarError, GrammarSpec, unsupported_keywords
from router.http.schemas import ChatCompletionRequest
from router.validation import RequestError

MAX_TOOLS = 128  # OpenAI's limit
MAX_FORCED_CALLS = 8  # calls in one forced answer (more than any real turn makes at once)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
_NO_PARAMETERS = {"type": "object", "properties": {}}


def check_tools(body: ChatCompletionRequest) -> None:
    """Refuses malformed tools and a tool_choice they cannot satisfy, by field."""
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, legacy) is not None:
            raise RequestError(f"{legacy}: deprecated by OpenAI and not supported; send {current}")
    if not body.tools:
        if body.tools is not None:
            raise RequestError("tools: empty list; leave it out for no tools")
        if body.tool_choice not in (None, "none"):
            raise RequestError("tool_choice: requires tools")
        return
    if len(body.tools) > MAX_TOOLS:
        raise RequestError(f"tools: {len(body.tools)} tools; at most {MAX_TOOLS} are allowed")
    names: set[str] = set()
    for i, tool in enumerate(body.tools):
        name = _check_tool(f"tools[{i}]", tool)
        if name in names:
            raise RequestError(f"tools[{i}].function.name: {name!r} is declared twice")
        names.add(name)
    forced = forced_name(body)
    if forced is not None and forced not in names:
        raise RequestError(f"tool_choice: no tool named {forced!r} in tools")


def calls_wanted(body: ChatCompletionRequest) -> bool:
    """Whether the output is read for tool calls (tools given and tool_choice is not none)."""
    return bool(body.tools) and body.tool_choice != "none"


def forces_calls(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and (body.tool_choice == "required" or forced_name(body) is not None)


def forced_name(body: ChatCompletionRequest) -> str | None:
    """The function a named tool_choice forces; None for the string choices. RequestError for
    a tool_choice of another shape."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none", "required"):
        return None
    if isinstance(choice, str):
        raise RequestError(
            f"tool_choice: must be 'auto', 'none', 'required' or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}'
        )
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict):
        raise RequestError(
            'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}'
        )
    if not isinstance(function.get("name"), str):
        raise RequestError("tool_choice.function.name: a string is required")
    return function["name"]


def tool_grammar(body: ChatCompletionRequest) -> GrammarSpec | None:
    """The grammar of the calls `body` forces; None when the model is free to answer."""
    if not forces_calls(body):
        return None
    forced = forced_name(body)
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in _parameters(body.tools or []).items()
        if forced is None or name == forced
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
        "maxItems": 1 if body.parallel_tool_calls is False else MAX_FORCED_CALLS,
    }
    try:
        return GrammarSpec("json_schema", json.dumps(schema))
    except GrammarError as e:
        raise RequestError(f"tools: {str(e).removeprefix('grammar: ')}") from None


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as a chat template takes them (transformers' `tools=`: the OpenAI tool objects,
    parameters filled in)."""
    if not body.tools:
        return None
    return [
        {"type": "function", "function": {**tool["function"], "parameters": parameters}}
        for tool, parameters in zip(body.tools, _parameters(body.tools).values(), strict=True)
    ]


def _parameters(tools: list[dict[str, Any]]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"].get("parameters") or _NO_PARAMETERS for t in tools}


def _check_tool(field: str, tool: Any) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise RequestError(f"{field}.type: must be 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"{field}.function: an object with the function's name is required")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise RequestError(
            f"{field}.function.name: 1 to 64 letters, digits, '_' or '-' are required, got {name!r}"
        )
    if not isinstance(function.get("description", ""), str):
        raise RequestError(f"{field}.function.description: must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        return name
    if not isinstance(parameters, dict):
        raise RequestError(f"{field}.function.parameters: a JSON schema object is required")
    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise RequestError(
            f"{field}.function.parameters{where}: not a valid JSON schema: {e.message}"
        ) from None
    if parameters.get("type", "object") != "object":
        raise RequestError(f"{field}.function.parameters.type: must be 'object'")
    strict = function.get("strict") or False
    if not isinstance(strict, bool):
        raise RequestError(f"{field}.function.strict: must be a boolean")
    unsupported = sorted(unsupported_keywords(parameters))
    if strict and unsupported:
        raise RequestError(
            f"{field}.function.parameters: strict schema uses unsupported keyword(s) {unsupported}"
        )
    return name
