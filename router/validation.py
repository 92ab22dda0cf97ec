"""Turns a client's GenerateRequest into a WorkRequest, or says exactly which field is wrong.

Everything a client can get wrong is caught here, at the edge, so workers only ever see valid
requests; the server answers a RequestError with INVALID_ARGUMENT and its message.
"""

from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass

from pdserve.core.sampling_params import SamplingParams
from pdserve.pb import generate_pb2

DEFAULT_MAX_TOKENS = 64
MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_LEN = 256


class RequestError(ValueError):
    """A client error; the message names the field."""


@dataclass
class ModelLimits:
    """What the router checks requests against."""

    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]


def validate(
    request: generate_pb2.GenerateRequest, limits: ModelLimits, tokenize
) -> tuple[str, list[int], SamplingParams]:
    """Returns (request_id, prompt token ids, sampling params); raises RequestError."""
    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise RequestError(f"request_id: longer than {MAX_REQUEST_ID_LEN} characters")
    if request.model and request.model != limits.name:
        raise RequestError(
            f"model: unknown model {request.model!r}; this server serves {limits.name!r}"
        )
    prompt_ids = _prompt_ids(request, limits, tokenize)
    sampling = _sampling(request.sampling if request.HasField("sampling") else None, limits)
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
    return request_id, prompt_ids, sampling


def _prompt_ids(request: generate_pb2.GenerateRequest, limits: ModelLimits, tokenize) -> list[int]:
    which = request.WhichOneof("prompt")
    if which is None:
        raise RequestError("prompt: missing; set prompt.text or prompt.token_ids")
    if which == "text":
        if not request.text:
            raise RequestError("prompt.text: empty prompt")
        ids = tokenize(request.text)
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
    if top_k < 0:
        raise RequestError(f"sampling.top_k: must be >= 0 (0 = off), got {top_k}")
    max_tokens = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise RequestError("sampling.max_tokens: must be >= 1")
    stop = list(params.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise RequestError(f"sampling.stop: at most {MAX_STOP_STRINGS} non-empty strings")
    bad = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise RequestError(f"sampling.stop_token_ids: token id {bad} is outside the vocabulary")
    stop_ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids += [t for t in limits.eos_token_ids if t not in stop_ids]
    # An unseeded sampled request still gets a fixed seed: the prefill and decode workers, and
    # a retry, must continue one random stream.
    seed = params.seed if params.HasField("seed") else secrets.randbits(63)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_token_ids=stop_ids,
        stop=stop,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
    )
