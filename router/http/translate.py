"""OpenAI request bodies → the GenerateRequest the gRPC API takes, so both APIs share one
validation (router/validation.py) and one set of limits. The few OpenAI fields pdserve does not
implement are refused here, by name; validation's messages are renamed to OpenAI's fields."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pdserve.core.grammar_spec import GrammarError, GrammarSpec
from pdserve.pb import generate_pb2
from router.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.http.tool_messages import with_tool_calls_for_template
from router.http.tool_request import check_tools, forces_calls, tool_grammar
from router.validation import RequestError

MAX_PROMPTS = 64  # prompts of one completions request
_INT32 = 1 << 31
_UINT32 = 1 << 32
_UINT64 = 1 << 64
_SAMPLING_FIELD = re.compile(r"^sampling\.(\w+): ")
_PROMPT_FIELD = re.compile(r"^prompt(\.text|\.token_ids)?: ")

Prompt = str | list[int]


def check_supported(body: SamplingFields) -> None:
    """Refuses, by name, the OpenAI options pdserve does not implement (neutral values pass)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise RequestError(f"{name}: not supported; leave it unset or 0")
    if body.logit_bias:
        raise RequestError("logit_bias: not supported")
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options: only allowed when stream is true")
    if isinstance(body, CompletionRequest):
        _check_completion(body)
    elif isinstance(body, ChatCompletionRequest):
        _check_chat(body)


def _check_completion(body: CompletionRequest) -> None:
    if body.logprobs is not None and body.logprobs != 0:
        raise RequestError(
            "logprobs: only 0 is supported (the sampled tokens' log-probabilities, "
            "without alternatives)"
        )
    if body.echo:
        raise RequestError("echo: not supported")
    if body.best_of not in (None, 1):
        raise RequestError("best_of: only 1 is supported")
    if body.suffix:
        raise RequestError("suffix: not supported")


def _check_chat(body: ChatCompletionRequest) -> None:
    if body.top_logprobs not in (None, 0):
        raise RequestError(
            "top_logprobs: only 0 is supported (logprobs=true gives the sampled tokens' "
            "log-probabilities, without alternatives)"
        )
    check_tools(body)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The prompts of a completions request: one text or token id list each."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt: empty list")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"prompt: {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed")
    return list(prompt)


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the template gets them (list content as its parts, which the template
    renders or joins: chat_template.py); only text parts are accepted."""
    messages = []
    for i, message in enumerate(body.messages):
        fields = message.model_dump(exclude_none=True)
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if part.type != "text" or part.text is None:
                raise RequestError(
                    f"messages[{i}].content[{j}]: only text parts are supported, "
                    f"got type {part.type!r}"
                )
        messages.append(fields)
    return with_tool_calls_for_template(messages)


def max_tokens_field(body: SamplingFields) -> str:
    """The name the client used for the output length (chat has two)."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def generate_request(body: SamplingFields, prompt: Prompt) -> generate_pb2.GenerateRequest:
    """The GenerateRequest that asks for what `body` asks, for one prompt."""
    request = generate_pb2.GenerateRequest(model=body.model or "")
    if isinstance(prompt, str):
        request.text = prompt
    else:
        _check_ids("prompt", prompt)
        request.token_ids.ids.extend(prompt)
    sampling = request.sampling
    sampling.SetInParent()
    name = max_tokens_field(body)
    max_tokens = getattr(body, name)
    if max_tokens is not None:
        if max_tokens < 1:
            raise RequestError(f"{name}: must be >= 1")
        sampling.max_tokens = min(max_tokens, _UINT32 - 1)  # beyond any context: caught later
    if body.min_tokens is not None:
        if not 0 <= body.min_tokens < _UINT32:
            raise RequestError(f"min_tokens: must be >= 0, got {body.min_tokens}")
        sampling.min_tokens = body.min_tokens
    if body.temperature is not None:
        sampling.temperature = body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    if body.min_p is not None:
        sampling.min_p = body.min_p
    if body.top_k is not None:
        if not -1 <= body.top_k < _INT32:
            raise RequestError(f"top_k: must be >= 0 (0 or -1 = off) and < 2^31, got {body.top_k}")
        sampling.top_k = 0 if body.top_k == -1 else body.top_k  # vLLM's -1 = off
    if body.seed is not None:
        if not 0 <= body.seed < _UINT64:
            raise RequestError(f"seed: must be in [0, 2^64), got {body.seed}")
        sampling.seed = body.seed
    if body.stop is not None:
        sampling.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        _check_ids("stop_token_ids", body.stop_token_ids)
        sampling.stop_token_ids.extend(body.stop_token_ids)
    sampling.ignore_eos = body.ignore_eos
    sampling.logprobs = wants_logprobs(body)
    _decoding_rule(body, sampling)
    spec = grammar_spec(body)
    if spec is not None:
        _set_grammar(sampling.grammar, spec)
    return request


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def grammar_field(body: SamplingFields) -> str:
    """The field the client asked for structured output with."""
    if isinstance(body, ChatCompletionRequest) and forces_calls(body):
        return "tools"
    return next((name for name in _GUIDED if getattr(body, name) is not None), "response_format")


def grammar_spec(body: SamplingFields) -> GrammarSpec | None:
    """The grammar `body` asks for (None: free text); RequestError naming the field when it
    is malformed or when two fields ask for one."""
    asked = [name for name in _GUIDED if getattr(body, name) is not None]
    response_format = body.response_format or {}
    kind = response_format.get("type", "text")
    if kind != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise RequestError(f"{asked[1]}: conflicts with {asked[0]}; ask for one grammar")
    tools = tool_grammar(body) if isinstance(body, ChatCompletionRequest) else None
    if tools is not None:
        if asked:
            raise RequestError(f"{asked[0]}: conflicts with tool_choice, which forces tool calls")
        return tools
    if not asked:
        return None
    field = asked[0]
    try:
        if field == "response_format":
            return _response_format(kind, response_format)
        if field == "guided_json":
            schema = body.guided_json
            return GrammarSpec(
                "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
            )
        if field == "guided_choice":
            return GrammarSpec("choice", choices=tuple(body.guided_choice or ()))
        if field == "guided_regex":
            return GrammarSpec("regex", body.guided_regex or "")
        return GrammarSpec("ebnf", body.guided_grammar or "")
    except GrammarError as exc:
        raise RequestError(f"{field}: {str(exc).removeprefix('grammar: ')}") from None


def _response_format(kind: str, response_format: dict[str, Any]) -> GrammarSpec:
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise GrammarError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        raise GrammarError("json_schema.schema: a JSON schema object is required")
    strict = json_schema.get("strict") or False
    if not isinstance(strict, bool):
        raise GrammarError("json_schema.strict: must be a boolean")
    return GrammarSpec("json_schema", json.dumps(json_schema["schema"]), strict=strict)


def _set_grammar(grammar: generate_pb2.Grammar, spec: GrammarSpec) -> None:
    if spec.kind == "json_object":
        grammar.json_object = True
    elif spec.kind == "choice":
        grammar.choice.choices.extend(spec.choices)
    else:
        setattr(grammar, spec.kind, spec.text)
    grammar.strict = spec.strict


def _decoding_rule(body: SamplingFields, sampling: generate_pb2.SamplingParams) -> None:
    """n, beam search, repetition penalty, DoLa, SLED and the speculation opt-out: copied as
    given (validation checks them and names the field)."""
    for name in ("n", "beam_width", "evolution_scale"):
        value = getattr(body, name)
        if value is not None:
            if not 0 <= value < _UINT32:
                raise RequestError(f"{name}: must be in [0, 2^32), got {value}")
            setattr(sampling, name, value)
    for name in ("length_penalty", "repetition_penalty", "evolution_rate", "evolution_lower_bound"):
        value = getattr(body, name)
        if value is not None:
            setattr(sampling, name, value)
    sampling.early_stopping = body.early_stopping
    sampling.sled = body.sled
    sampling.disable_speculation = body.disable_speculation
    for name in ("dola_layers", "sled_layers"):
        layers = getattr(body, name)
        if isinstance(layers, str):
            getattr(sampling, name).preset = layers
        elif layers is not None:
            if any(not 0 <= i < _UINT32 for i in layers):
                raise RequestError(f"{name}: layer indices must be >= 0")
            getattr(sampling, name).indices.layers.extend(layers)
            getattr(sampling, name).indices.SetInParent()


def wants_logprobs(body: SamplingFields) -> bool:
    if isinstance(body, ChatCompletionRequest):
        return body.logprobs
    return getattr(body, "logprobs", None) is not None


def openai_names(
    error: RequestError, prompt_field: str, max_tokens_name: str, grammar_name: str = "grammar"
) -> RequestError:
    """Validation's message with the gRPC field names replaced by the OpenAI request's."""
    message = str(error)
    message = _PROMPT_FIELD.sub(f"{prompt_field}: ", message)
    sampling = _SAMPLING_FIELD.match(message)
    if sampling:
        field = max_tokens_name if sampling.group(1) == "max_tokens" else sampling.group(1)
        field = grammar_name if field == "grammar" else field
        message = f"{field}: " + message[sampling.end() :]
    message = message.replace("sampling.max_tokens", max_tokens_name)
    return RequestError(message)


def _check_ids(field: str, ids: Sequence[int]) -> None:
    bad = next((t for t in ids if not 0 <= t < _UINT32), None)
    if bad is not None:
        raise RequestError(f"{field}: token id {bad} is outside the vocabulary")
