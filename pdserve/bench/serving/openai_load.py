"""Drives any OpenAI-compatible server (pdserve's HTTP API, vLLM, SGLang, TGI...) with a
workload: streaming `/v1/completions` with token-id prompts, so pdserve and a peer run the
same requests and are measured by the same client code (`pdserve bench serve --backend openai`).

Tokens per chunk: a chunk's `token_ids` when the server returns them (`return_token_ids`, a
pdserve and vLLM extension), else one per chunk with text; the usage chunk then settles the
total, so output token counts match the server's. Events that arrive in one read of the stream
are one chunk: the reader got their tokens at once, and a 0 ms gap between them is not an ITL.

The token ids of synthetic prompts stay below the vocabulary of the model card (`vocab_size`
when the server says it; a built-in model's, known from its served name), or `--vocab-size`.

The client is aiohttp (its HTTP parser is C) reading the stream as raw bytes: a benchmark
client in Python must cost far less per event than the server it measures, or its own parsing
shows up as inter-token latency (`pdserve bench api` runs it in the router's process).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from pdserve.bench.common.load_generator import drive
from pdserve.models.presets import PRESETS
from pdserve.workloads.datasets import BenchRequest
from pdserve.workloads.metrics import RequestRecord

# What a failed request may raise: the connection's errors, a deadline, a malformed event.
_FAILURES = (TimeoutError, aiohttp.ClientError, ValueError)


# The directory name of a built-in model (pdserve/models/builtin.py), which pdserve serves it as.
_BUILTIN_NAME = re.compile(r"(?P<preset>\w+)-llama-v\d+")


@dataclass
class ModelCard:
    name: str
    max_model_len: int | None  # when the server says (pdserve and vLLM do)
    # The card's own `vocab_size` when it has one, else a built-in preset's (pdserve serving its
    # built-in model); None when neither says.
    vocab_size: int | None = None


def card_vocab_size(card: dict) -> int | None:
    """The vocabulary size a /v1/models card says, or its built-in model's."""
    if isinstance(card.get("vocab_size"), int):
        return card["vocab_size"]
    builtin = _BUILTIN_NAME.fullmatch(card["id"])
    preset = PRESETS.get(builtin["preset"]) if builtin else None
    return preset["vocab_size"] if preset else None


async def model_card(base_url: str, api_key: str | None, model: str | None = None) -> ModelCard:
    """The served model (`model`, or the first one `/v1/models` lists); raises
    aiohttp.ClientError when the server cannot be reached or answers with an error."""
    async with (
        aiohttp.ClientSession(
            headers=_headers(api_key), timeout=aiohttp.ClientTimeout(total=30)
        ) as session,
        session.get(f"{base_url.rstrip('/')}/models", raise_for_status=True) as r,
    ):
        cards = (await r.json())["data"]
    card = next((c for c in cards if model in (None, c["id"])), None)
    if card is None:
        raise ValueError(
            f"--model {model}: not served; the server lists {[c['id'] for c in cards]}"
        )
    return ModelCard(card["id"], card.get("max_model_len"), card_vocab_size(card))


async def run_openai_load(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = False,
    api_key: str | None = None,
    timeout: float | None = None,
) -> list[RequestRecord]:
    """Like load_generator.run_load, over HTTP: greedy, `max_tokens` = output_len,
    `ignore_eos`; failures are records with `error_code` "HTTP_<status>" or the exception's."""
    url = f"{base_url.rstrip('/')}/completions"
    async with aiohttp.ClientSession(
        headers=_headers(api_key),
        # No cap on connections (drive() caps requests in flight) and no deadline but --timeout.
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as session:

        async def send(request, record, slots, on_done) -> None:
            async with slots or contextlib.nullcontext():
                await _send(session, url, model, request, record)
            on_done(record)

        return await drive(
            requests,
            send,
            request_rate=request_rate,
            burstiness=burstiness,
            max_concurrency=max_concurrency,
            seed=seed,
            progress=progress,
        )


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    request: BenchRequest,
    record: RequestRecord,
) -> None:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    record.send_time = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                record.error_code, record.error = f"HTTP_{response.status}", text[:500]
            else:
                usage = await _read_events(response.content, record)
    except _FAILURES as error:
        record.error_code, record.error = type(error).__name__, str(error)
    record.end_time = time.perf_counter()
    if usage:
        _settle(record, usage)
    if record.error_code is None:
        if record.finish_reason in ("stop", "length"):
            record.ok = True
        else:
            record.error_code, record.error = "INCOMPLETE", "stream ended without finishing"


async def _read_events(stream: aiohttp.StreamReader, record: RequestRecord) -> dict | None:
    """Records every server-sent event of the stream as it arrives (all the events of one
    read at that read's time); returns the usage the stream reported, if any."""
    usage, pending = None, b""
    async for data in stream.iter_any():
        now = time.perf_counter()  # first: parsing is not latency
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            usage = _take(line, now, record) or usage
    return _take(pending, time.perf_counter(), record) or usage


def _take(line: bytes, now: float, record: RequestRecord) -> dict | None:
    """Records one line of the event stream; returns its usage, if it carries it."""
    if not line.startswith(b"data:"):
        return None  # blank lines between events, comments, other fields
    data = line[len(b"data:") :].strip()
    if data == b"[DONE]":
        return None
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        record.error_code, record.error = str(error.get("type", "error")), error.get("message", "")
        return None
    for choice in event.get("choices") or ():
        tokens = len(choice.get("token_ids") or ()) or (1 if choice.get("text") else 0)
        if tokens and record.chunk_times and record.chunk_times[-1] == now:
            # Events of one read reached the reader together: one delivery, not a 0 ms ITL.
            record.chunk_tokens[-1] += tokens
        elif tokens:
            record.chunk_times.append(now)
            record.chunk_tokens.append(tokens)
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    return event.get("usage")


def _settle(record: RequestRecord, usage: dict) -> None:
    """Output tokens as the server counted them (a chunk may carry several without saying)."""
    details = usage.get("prompt_tokens_details") or {}
    record.cached_prompt_tokens = details.get("cached_tokens") or 0
    missing = usage.get("completion_tokens", 0) - sum(record.chunk_tokens)
    if missing > 0 and record.chunk_tokens:
        record.chunk_tokens[-1] += missing


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
