"""Process-wide logging: text for people, JSON lines for log pipelines.

Every record carries the request it belongs to (`request_id_var`, set by whoever handles
the request) and the current OpenTelemetry trace id, so a log line leads to its trace.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

from opentelemetry import trace

# Context variables follow asyncio tasks and are copied into threads started with
# contextvars.copy_context, so concurrent requests never see each other's id.
request_id_var: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextmanager
def bind_request_id(request_id: str) -> Iterator[None]:
    """Sets `request_id_var` for the duration of a block."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


class ContextFilter(logging.Filter):
    """Adds `request_id` and `trace_id`/`span_id` (hex, or None) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = f"{ctx.trace_id:032x}" if ctx.is_valid else None
        record.span_id = f"{ctx.span_id:016x}" if ctx.is_valid else None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line; keys absent when there is nothing to say."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id", "span_id"):
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The usual text line, with ` [request_id=... trace_id=...]` when known."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        tags = [
            f"{key}={getattr(record, key)}"
            for key in ("request_id", "trace_id")
            if getattr(record, key, None) is not None
        ]
        return f"{text} [{' '.join(tags)}]" if tags else text


_handler: logging.Handler | None = None


def setup_logging(level: int | str = "INFO", fmt: str = "text") -> logging.Handler:
    """Installs one stderr handler on the root logger (replacing the one a previous call
    installed, so calling it again just changes level or format)."""
    global _handler
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    _handler = handler
    return handler
