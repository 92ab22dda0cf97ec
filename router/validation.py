"""Turns a client's GenerateRequest into a ValidRequest, or says exactly which field is wrong.

Everything a client can get wrong is caught here, at the edge, so workers only ever see valid
requests; the server answers a RequestError with INVALID_ARGUMENT and its message. The cheap
checks run first and prompt text is measured in bytes before it is tokenized, so an oversized
request costs the router nothing.
"""

from __future__ import annotations

import math
import re
import secrets
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.core.grammar_spec import GrammarError, GrammarSpec
from pdserve.core.sampling_params import SamplingParams
from pdserve.pb import generate_pb2

DEFAULT_MAX_TOKENS = 64
# A text prompt's byte cap is the context's worth of text at this many UTF-8 bytes per token:
# BPE vocabularies average ~4 bytes of English per token, a CJK character is 3 bytes and often
# a token of its own, long whitespace or punctuation runs are single tokens of up to ~16 bytes.
# A text over the cap cannot fit the context, and is refused before it is tokenized.
MAX_BYTES_PER_TOKEN = 32
MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# Room in a request for everything but the prompt, with every other field at its cap.
_ENVELOPE_BYTES = 64 << 10
_VARINT_BYTES = 5  # most bytes one uint32 token id takes on the wire
# Printable ASCII without spaces: a request id lands in log lines, which it must not break.
_REQUEST_ID = re.compile(r"[\x21-\x7e]*")

Tokenize = Callable[[str], Awaitable[list[int]]]


class RequestError(ValueError):
    """A client error; the message names the field."""


@dataclass
class ModelLimits:
    """What the router checks requests against."""

    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    # UTF-8 bytes of a text prompt; 0 = the context's worth (default_prompt_bytes).
    max_prompt_bytes: int = 0
    num_layers: int = 0  # decoder layers (bounds DoLa/SLED layer indices); 0 = unknown

    def __post_init__(self) -> None:
        if not self.max_prompt_bytes:
            self.max_prompt_bytes = default_prompt_bytes(self.max_model_len)


def default_prompt_bytes(max_model_len: int) -> int:
    """The text prompt cap that matches a context of `max_model_len` tokens."""
    return MAX_BYTES_PER_TOKEN * max_model_len


@dataclass
class ValidRequest:
    """A checked request. `request_id` is for the client (echoed) and the logs; `work_id` is
    made here, unique per request, and is the only key workers and aborts ever use, so one
    client reusing an id cannot touch another client's request."""

    request_id: str
    work_id: str
    prompt_ids: list[int]
    sampling: SamplingParams


def max_request_bytes(limits: ModelLimits) -> int:
    """The largest valid GenerateRequest on the wire: the gRPC receive limit that matches."""
    prompt = max(limits.max_prompt_bytes, limits.max_model_len * _VARINT_BYTES)
    return prompt + _ENVELOPE_BYTES


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise RequestError(f"request_id: longer than {MAX_REQUEST_ID_LEN} characters")
    if not _REQUEST_ID.fullmatch(request_id):
        raise RequestError("request_id: only printable ASCII characters without spaces are allowed")


def check_text_size(field: str, text: str, max_bytes: int) -> None:
    """Rejects text over `max_bytes` UTF-8 bytes (before anyone spends time tokenizing it)."""
    # A character is at least one byte: most oversized texts are caught without encoding.
    size = len(text) if len(text) > max_bytes else len(text.encode("utf-8"))
    if size > max_bytes:
        raise RequestError(f"{field}: {size} bytes exceed the limit of {max_bytes} bytes")


def check_model(field: str, model: str, limits: ModelLimits) -> None:
    if model and model != limits.name:
        raise RequestError(f"{field}: unknown model {model!r}; this server serves {limits.name!r}")


async def validate(
    request: generate_pb2.GenerateRequest, limits: ModelLimits, tokenize: Tokenize
) -> ValidRequest:
    """Checks every field, then tokenizes a text prompt; raises RequestError."""
    work_id = uuid.uuid4().hex
    check_request_id(request.request_id)
    check_model("model", request.model, limits)
    sampling = _sampling(request.sampling if request.HasField("sampling") else None, limits)
    prompt_ids = await _prompt_ids(request, limits, tokenize)
    if len(prompt_ids) >= limits.max_model_len:
        raise RequestError(
            f"prompt: {len(prompt_ids)} tokens do not fit the context of "
            f"{limits.max_model_len} tokens (at least one token must be generated)"
        )
    if len(prompt_ids) + sampling.max_tokens > limits.max_model_len:
        raise RequestError(
            f"sampling.max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens "
            f"({sampling.max_tokens}) exceeds the context of "
            f"{limits.max_model_len} tokens"
        )
    return ValidRequest(request.request_id or work_id, work_id, prompt_ids, sampling)


async def _prompt_ids(
    request: generate_pb2.GenerateRequest, limits: ModelLimits, tokenize: Tokenize
) -> list[int]:
    which = request.WhichOneof("prompt")
    if which is None:
        raise RequestError("prompt: missing; set prompt.text or prompt.token_ids")
    if which == "text":
        if not request.text:
            raise RequestError("prompt.text: empty prompt")
        check_text_size("prompt.text", request.text, limits.max_prompt_bytes)
        ids = await tokenize(request.text)
        if not ids:
            raise RequestError("prompt.text: the prompt tokenizes to no tokens")
        return ids
    ids = list(request.token_ids.ids)
    if not ids:
        raise RequestError("prompt.token_ids: empty prompt")
    bad = next((t for t in ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"prompt.token_ids: token id {bad} is outside the vocabulary (size {limits.vocab_size})"
        )
    return ids


def _sampling(params: generate_pb2.SamplingParams | None, limits: ModelLimits) -> SamplingParams:
    if params is None:
        return SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS, stop_token_ids=list(limits.eos_token_ids)
        )
    temperature = params.temperature if params.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestError(f"sampling.temperature: must be >= 0 (0 = greedy), got {temperature}")
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise RequestError(f"sampling.top_p: must be in (0, 1], got {top_p}")
    top_k = params.top_k if params.HasField("top_k") else 0
    min_p = params.min_p if params.HasField("min_p") else 0.0
    if top_k < 0:
        raise RequestError(f"sampling.top_k: must be >= 0 (0 = off), got {top_k}")
    max_tokens = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise RequestError("sampling.max_tokens: must be >= 1")
    stop = _stop_strings(params)
    stop_ids = _stop_token_ids(params, limits)
    # An unseeded sampled request still gets a fixed seed: the prefill and decode workers, and
    # a retry, must continue one random stream.
    seed = params.seed if params.HasField("seed") else secrets.randbits(63)
    rule = _decoding_rule(params, limits)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            stop_token_ids=stop_ids,
            stop=stop,
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs,
            **rule,
        )
    except ValueError as exc:  # SamplingParams names the field first
        raise RequestError(f"sampling.{exc}") from exc


def _decoding_rule(params: generate_pb2.SamplingParams, limits: ModelLimits) -> dict:
    """n, beam search, repetition penalty, DoLa, SLED and the speculation opt-out: the fields
    set, as SamplingParams keywords (unset ones keep SamplingParams' defaults). The opt-out
    combines with everything: the engine itself never speculates on the rules it cannot."""
    rule: dict = {
        "early_stopping": params.early_stopping,
        "sled": params.sled,
        "speculative": not params.disable_speculation,
    }
    if params.HasField("grammar"):
        rule["grammar"] = _grammar(params.grammar)
    for name in (
        "n",
        "beam_width",
        "length_penalty",
        "repetition_penalty",
        "evolution_rate",
        "evolution_scale",
        "evolution_lower_bound",
    ):
        if params.HasField(name):
            rule[name] = getattr(params, name)
    for name in ("dola_layers", "sled_layers"):
        if params.HasField(name):
            rule[name] = _layers(name, getattr(params, name), limits)
    return rule


def _grammar(grammar: generate_pb2.Grammar) -> GrammarSpec:
    kind = grammar.WhichOneof("spec")
    try:
        if kind is None:
            raise GrammarError("grammar: set one of json_object, json_schema, regex, choice, ebnf")
        if grammar.strict and kind != "json_schema":
            raise GrammarError("grammar: strict applies to json_schema only")
        if kind == "json_object":
            return GrammarSpec(kind)
        if kind == "choice":
            return GrammarSpec(kind, choices=tuple(grammar.choice.choices))
        return GrammarSpec(kind, getattr(grammar, kind), strict=grammar.strict)
    except GrammarError as exc:
        raise RequestError(f"sampling.{exc}") from None


def _layers(
    name: str, selection: generate_pb2.LayerSelection, limits: ModelLimits
) -> str | list[int]:
    which = selection.WhichOneof("selection")
    if which is None:
        raise RequestError(f"sampling.{name}: set preset or indices")
    if which == "preset":
        return selection.preset
    layers = list(selection.indices.layers)
    too_deep = [i for i in layers if limits.num_layers and i >= limits.num_layers]
    if too_deep:
        raise RequestError(
            f"sampling.{name}: layer {too_deep[0]} is not before the final layer "
            f"(the model has {limits.num_layers} layers)"
        )
    return layers


def _stop_strings(params: generate_pb2.SamplingParams) -> list[str]:
    stop = list(params.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise RequestError(f"sampling.stop: at most {MAX_STOP_STRINGS} non-empty strings")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise RequestError(
            f"sampling.stop: a stop string has {longest} characters; "
            f"at most {MAX_STOP_STRING_CHARS} are allowed"
        )
    return stop


def _stop_token_ids(params: generate_pb2.SamplingParams, limits: ModelLimits) -> list[int]:
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(
            f"sampling.stop_token_ids: {len(params.stop_token_ids)} ids; "
            f"at most {MAX_STOP_TOKEN_IDS} are allowed"
        )
    bad = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise RequestError(f"sampling.stop_token_ids: token id {bad} is outside the vocabulary")
    stop_ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids += [t for t in limits.eos_token_ids if t not in stop_ids]
    return stop_ids
