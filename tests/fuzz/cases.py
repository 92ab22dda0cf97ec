"""Hypothesis strategies for the API's requests, and the oracle of what each must get.

Every field is drawn from valid and invalid values alike. `problems(request)` names the
fields the documented rules (generate.proto, router/validation.py) reject, from an
independent reading of those rules: a request with none must complete, one with some must
get INVALID_ARGUMENT with a message that starts with one of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import strategies as st

from pdserve.pb import generate_pb2
from router.validation import MAX_REQUEST_ID_LEN, MAX_STOP_STRINGS

# Stop lists and strings beyond these sizes have no documented limit yet: such a request
# may complete or be rejected naming the field, never anything else.
ROOMY_STOP_STRINGS = 4
ROOMY_STOP_LEN = 64
ROOMY_STOP_IDS = 64


@dataclass(frozen=True)
class Model:
    """What the served model accepts."""

    name: str
    vocab_size: int
    max_model_len: int
    encode: Callable[[str], list[int]]  # a prompt's token ids (special tokens added)


@dataclass
class Verdict:
    """The fields a request gets wrong (`must_reject`), and those it may be rejected for."""

    must_reject: set[str] = field(default_factory=set)
    may_reject: set[str] = field(default_factory=set)
    prompt_tokens: int = 0
    max_tokens: int = 64


def token_ids(vocab_size: int, *, max_size: int) -> st.SearchStrategy[list[int]]:
    """Mostly in-vocabulary ids, sometimes just past it or anywhere in uint32."""
    inside = st.integers(0, vocab_size - 1)
    outside = st.one_of(st.integers(vocab_size, vocab_size + 3), st.integers(0, 2**32 - 1))
    return st.lists(st.one_of(inside, inside, inside, outside), max_size=max_size)


def sampling(vocab_size: int) -> st.SearchStrategy[generate_pb2.SamplingParams]:
    floats32 = st.floats(width=32)  # nan, inf, -0.0, subnormals included
    return st.builds(
        _sampling_params,
        temperature=st.none() | st.sampled_from([0.0, 0.7, 1.0, -1.0]) | floats32,
        top_k=st.none() | st.integers(-3, 8) | st.integers(-(2**31), 2**31 - 1),
        top_p=st.none() | st.sampled_from([1.0, 0.9, 0.0, 1.5]) | floats32,
        seed=st.none() | st.integers(0, 2**64 - 1),
        # Small counts keep the suite fast; 0 and past-the-context are the invalid ones
        # (the default of 64 is drawn rarely: it is the slowest valid case).
        max_tokens=st.one_of(
            *[st.integers(0, 3)] * 4, st.none(), st.sampled_from([2**32 - 1, 100_000])
        ),
        stop_token_ids=token_ids(vocab_size, max_size=4) | st.just(list(range(3, 303))),
        stop=st.lists(st.text(max_size=8), max_size=MAX_STOP_STRINGS + 2)
        | st.lists(st.text(min_size=ROOMY_STOP_LEN + 1, max_size=4000), min_size=1, max_size=2),
        ignore_eos=st.booleans(),
        logprobs=st.booleans(),
    )


def _sampling_params(**fields) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


def generate_requests(model: Model) -> st.SearchStrategy[generate_pb2.GenerateRequest]:
    prompts = st.one_of(
        st.none(),
        st.text(max_size=64).map(lambda t: {"text": t}),
        st.text(min_size=1500, max_size=3000).map(lambda t: {"text": t}),
        token_ids(model.vocab_size, max_size=48).map(lambda ids: {"token_ids": {"ids": ids}}),
        st.integers(model.max_model_len - 4, model.max_model_len + 1).map(
            lambda n: {"token_ids": {"ids": [5] * n}}
        ),
    )
    return st.builds(
        _generate_request,
        request_id=st.sampled_from(["", "fuzz", "fuzz-2"])
        | st.text(max_size=16)
        | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=300),
        model=st.sampled_from(["", model.name]) | st.text(max_size=12),
        prompt=prompts,
        sampling=st.none() | sampling(model.vocab_size),
    )


def _generate_request(request_id, model, prompt, sampling) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=request_id, model=model, **(prompt or {}))
    if sampling is not None:
        request.sampling.CopyFrom(sampling)
    return request


def tokenize_requests(model: Model) -> st.SearchStrategy[generate_pb2.TokenizeRequest]:
    return st.builds(
        generate_pb2.TokenizeRequest,
        model=st.sampled_from(["", model.name]) | st.text(max_size=12),
        text=st.text(max_size=200),
        add_special_tokens=st.booleans(),
    )


def raw_bytes(valid: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """Bytes on the wire: noise, valid messages with bytes flipped, invalid UTF-8 strings."""
    serialized = valid.map(lambda m: m.SerializeToString())
    bad_utf8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
    return st.one_of(
        st.binary(max_size=256),
        st.builds(_flip, serialized, st.integers(0, 2**16), st.integers(1, 255)),
        # Field 1 (request_id / model of TokenizeRequest) and 3 (text / add_special_tokens),
        # length-delimited, holding bytes that are not UTF-8.
        st.builds(
            lambda tag, junk, rest: bytes([tag, len(junk)]) + junk + rest,
            st.sampled_from([0x0A, 0x12, 0x1A]),
            bad_utf8,
            serialized,
        ),
    )


def _flip(data: bytes, position: int, mask: int) -> bytes:
    if not data:
        return data
    i = position % len(data)
    return data[:i] + bytes([data[i] ^ mask]) + data[i + 1 :]


def judge(request: generate_pb2.GenerateRequest, model: Model) -> Verdict:
    """What the documented rules say about `request`."""
    verdict = Verdict()
    reject = verdict.must_reject
    request_id = request.request_id
    # Printable ASCII without spaces: ids end up in log lines.
    if len(request_id) > MAX_REQUEST_ID_LEN or any(not "!" <= c <= "~" for c in request_id):
        reject.add("request_id")
    if request.model not in ("", model.name):
        reject.add("model")
    which = request.WhichOneof("prompt")
    ids: list[int] = []
    if which is None or (which == "text" and not request.text):
        reject.add("prompt")
    elif which == "text":
        ids = list(model.encode(request.text))
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            reject.add("prompt")
        elif any(t >= model.vocab_size for t in ids):
            reject.add("prompt.token_ids")
    verdict.prompt_tokens = len(ids)
    if ids and len(ids) >= model.max_model_len:
        reject.add("prompt")
    params = request.sampling
    has = params.HasField
    max_tokens = params.max_tokens if has("max_tokens") else 64
    verdict.max_tokens = max_tokens
    fits = len(ids) < model.max_model_len  # else the prompt itself is rejected
    past_context = bool(ids) and fits and len(ids) + max_tokens > model.max_model_len
    if (has("max_tokens") and max_tokens < 1) or past_context:
        reject.add("sampling.max_tokens")
    if has("temperature") and not (math.isfinite(params.temperature) and params.temperature >= 0):
        reject.add("sampling.temperature")
    if has("top_p") and not (math.isfinite(params.top_p) and 0 < params.top_p <= 1):
        reject.add("sampling.top_p")
    if has("top_k") and params.top_k < 0:
        reject.add("sampling.top_k")
    if len(params.stop) > MAX_STOP_STRINGS or any(not s for s in params.stop):
        reject.add("sampling.stop")
    elif len(params.stop) > ROOMY_STOP_STRINGS or any(len(s) > ROOMY_STOP_LEN for s in params.stop):
        verdict.may_reject.add("sampling.stop")
    if any(t >= model.vocab_size for t in params.stop_token_ids):
        reject.add("sampling.stop_token_ids")
    elif len(params.stop_token_ids) > ROOMY_STOP_IDS:
        verdict.may_reject.add("sampling.stop_token_ids")
    return verdict
