"""Request bodies: read under a cap that matches the largest valid request, decoded and
validated (strict JSON types) off the event loop when they are large.

The router's one event loop serves gRPC and HTTP alike, so nothing a client sends may hold it:
a body over the cap is refused as it streams in (router/http/body_limit.py), and one over
`INLINE_BYTES` is decoded on the service's bounded pool (router/bounded_pool.py; full = 429).
Types are strict: `max_tokens: true`, `"8"` or `prompt: [true]` are 400s naming the field, as
is text that is not Unicode (a lone surrogate such as `\\ud800`, which JSON can spell).
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from router.http.schemas import MAX_MESSAGES
from router.http.translate import MAX_PROMPTS
from router.validation import ModelLimits, RequestError

M = TypeVar("M", bound=BaseModel)

# Bodies up to this size decode on the loop: well under a millisecond.
INLINE_BYTES = 64 << 10
# A request's texts together (its prompts, or a chat's messages) are at most this, or one
# prompt's cap if that is larger: a batch of longer texts is split over several requests.
REQUEST_TEXT_BYTES = 1 << 20
# JSON spells a UTF-8 byte in at most 6 bytes (a control character as \u0001).
_JSON_BYTES_PER_TEXT_BYTE = 6
# Everything but the texts and token ids: sampling fields, 16 stop strings of 256 characters,
# 256 stop token ids, chat template variables, and each message's role and punctuation.
_ENVELOPE_BYTES = 64 << 10
_MESSAGE_BYTES = 256
# A pydantic location's parts that name a union member's type, not a field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict)(\[.*\])?$|^function-")


def request_text_bytes(limits: ModelLimits) -> int:
    """The UTF-8 bytes of text one request may carry, all its prompts or messages together."""
    return max(limits.max_prompt_bytes, REQUEST_TEXT_BYTES)


def max_body_bytes(limits: ModelLimits) -> int:
    """The largest valid body: its text at JSON's widest spelling, or MAX_PROMPTS prompts of
    max_model_len token ids, with the envelope; larger bodies are refused unread (413)."""
    text = _JSON_BYTES_PER_TEXT_BYTE * request_text_bytes(limits)
    id_bytes = len(str(limits.vocab_size - 1)) + 1  # digits and a comma
    ids = MAX_PROMPTS * (limits.max_model_len * id_bytes + 2)
    return max(text, ids) + MAX_MESSAGES * _MESSAGE_BYTES + _ENVELOPE_BYTES


def decode(raw: bytes, model: type[M]) -> M:
    """The body as `model`; RequestError naming the field when it is not one."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise RequestError(f"body: not valid JSON ({_first_line(e)})") from None
    if not isinstance(data, dict):
        raise RequestError("body: must be a JSON object")
    _check_unicode(data, "")
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        raise RequestError(validation_message(e)) from None


def validation_message(exc: ValidationError) -> str:
    """'field: what is wrong' of the first error, the field as OpenAI names it."""
    error = exc.errors()[0]
    field = ""
    for part in error.get("loc", ()):
        if isinstance(part, int):
            field += f"[{part}]"
        elif _TYPE_TAG.match(str(part)):
            break
        else:
            field += f".{part}" if field else str(part)
    return f"{field or 'body'}: {error.get('msg', 'invalid')}"


def _check_unicode(value: Any, path: str) -> None:
    """Refuses strings that cannot be UTF-8 (lone surrogates), naming where they are."""
    if isinstance(value, str):
        if not value.isascii() and not _encodable(value):
            raise RequestError(f"{path or 'body'}: not valid Unicode text (a lone surrogate)")
    elif isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if path else key
            if not _encodable(key):
                raise RequestError(f"{path or 'body'}: a key is not valid Unicode text")
            _check_unicode(item, name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                _check_unicode(item, f"{path}[{i}]")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
