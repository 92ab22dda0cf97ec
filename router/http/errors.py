"""Errors as OpenAI clients expect them: `{"error": {message, type, param, code}}` with the
HTTP status that matches the gRPC one (router/errors.py decides both from the exception)."""

from __future__ import annotations

import re

import grpc
from fastapi.responses import JSONResponse

from router.errors import status_for

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
# Messages name the field first: "temperature: must be >= 0".
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class UnknownModel(LookupError):
    """The request names a model this server does not serve: 404."""


def error_body(status: int, message: str, code: str | None = None) -> dict:
    field = _FIELD.match(message)
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPE.get(status, "internal_error"),
            "param": field.group(1) if field else None,
            "code": code,
        }
    }


def status_and_body(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body of an exception; unexpected ones are 500 with a
    one-line message, never a traceback."""
    if isinstance(exc, UnknownModel):
        return 404, error_body(404, str(exc), "model_not_found")
    code, message = status_for(exc)
    status = HTTP_STATUS.get(code, 500)
    return status, error_body(status, message)


def error_response(exc: BaseException) -> JSONResponse:
    status, body = status_and_body(exc)
    return JSONResponse(body, status_code=status)
