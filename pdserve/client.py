"""Python client of the `pdserve.v1.Generation` gRPC service, sync and asyncio.

    with GenerationClient("127.0.0.1:50051") as client:
        for chunk in client.generate_stream("Hello", max_tokens=16):
            print(chunk.text, end="", flush=True)

    async with AsyncGenerationClient("127.0.0.1:50051") as client:
        completion = await client.generate([1, 2, 3], max_tokens=16, ignore_eos=True)

With `tls_ca=` (and `tls_cert=`/`tls_key=` for mutual TLS) the channel speaks TLS.
Every call sends `authorization: Bearer <api_key>` when a key is set, and the W3C trace context
(`traceparent`) of the current OpenTelemetry span when there is one. Closing a sync stream (or
breaking out of it), or cancelling / closing an async one, cancels the RPC on the server.
gRPC failures are raised as `GenerationError`, which carries the status code.

A process that reads many streamed responses (a load generator, a gateway) spends about a
quarter less CPU per response, and gets them with less jitter, with gRPC core's EventEngine
client off: `GRPC_EXPERIMENTS=-event_engine_client` in its environment before grpc is first
imported (`pdserve bench api` runs its clients so; BENCHMARKS.md, issue 15).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate

from pdserve.pb import generate_pb2, generate_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# FINISH_REASON_LENGTH -> "length", ...
_FINISH_REASONS = {
    v: k.removeprefix("FINISH_REASON_").lower() for k, v in generate_pb2.FinishReason.items()
}

Prompt = str | Sequence[int]  # text, or token ids of the served model
Metadata = Mapping[str, str] | Sequence[tuple[str, str]]
PemFile = str | Path  # a PEM file: CA bundle, certificate chain or private key
# A Tokenize response is several times its text's size: take what the server may send.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


class GenerationError(Exception):
    """A failed RPC: `code` is the `grpc.StatusCode`, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> GenerationError:
        return cls(error.code(), error.details() or "")


@dataclass
class Usage:
    """Token accounting of one request (mirrors `pdserve.v1.Usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class Timings:
    """Server-side timings in ms from the router's receipt (mirrors `pdserve.v1.Timings`)."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    prefill_worker: str = ""
    decode_worker: str = ""
    disaggregated: bool = False


def _from_pb(cls: type, message: Any) -> Any:
    return cls(**{f.name: getattr(message, f.name) for f in dataclasses.fields(cls)})


@dataclass
class Choice:
    """One choice of a completion (one of the n samples, or one of the best beams)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None if the stream broke off
    cumulative_logprob: float | None = None  # with logprobs or beam search
    score: float | None = None  # beam search: cumulative_logprob / length ** length_penalty

    def add(self, response: generate_pb2.GenerateResponse) -> None:
        self.text += response.text
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        if response.finish_reason:  # an unknown (newer) reason reads as "abort": not a success
            self.finish_reason = _FINISH_REASONS.get(response.finish_reason, "abort")
        if response.HasField("cumulative_logprob"):
            self.cumulative_logprob = response.cumulative_logprob
        if response.HasField("score"):
            self.score = response.score


@dataclass
class Completion:
    """A whole generation, assembled from its stream of `GenerateResponse`s. `text`,
    `token_ids`, `logprobs` and `finish_reason` are those of choice 0; `choices` holds every
    choice by index (n > 1 or beam search)."""

    request_id: str = ""
    choices: list[Choice] = field(default_factory=lambda: [Choice()])
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.choices[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    def add(self, response: generate_pb2.GenerateResponse) -> None:
        """Appends one response to its choice; the last response's usage and timings win (they
        are complete)."""
        self.request_id = response.request_id or self.request_id
        while len(self.choices) <= response.index:
            self.choices.append(Choice(index=len(self.choices)))
        self.choices[response.index].add(response)
        if response.HasField("usage"):
            self.usage = _from_pb(Usage, response.usage)
        if response.HasField("timings"):
            self.timings = _from_pb(Timings, response.timings)

    @classmethod
    def from_responses(cls, responses: Iterable[generate_pb2.GenerateResponse]) -> Completion:
        completion = cls()
        for response in responses:
            completion.add(response)
        return completion

    def to_dict(self) -> dict[str, Any]:
        """Choice 0's fields at the top level (as with n = 1), then every choice."""
        first = dataclasses.asdict(self.choices[0])
        return {
            "request_id": self.request_id,
            **{k: first[k] for k in ("text", "token_ids", "logprobs", "finish_reason")},
            "choices": [dataclasses.asdict(c) for c in self.choices],
            "usage": dataclasses.asdict(self.usage),
            "timings": dataclasses.asdict(self.timings),
        }


class GenerateParams(TypedDict, total=False):
    """Keyword parameters of `generate` / `generate_stream`. None or absent = server default
    (greedy, max_tokens 64, top_k 0, top_p 1, random seed)."""

    max_tokens: int | None
    min_tokens: int | None  # EOS and stops end the output only after this many tokens
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None  # keep tokens at least min_p x the most likely one's probability
    seed: int | None
    stop: Sequence[str]  # stop strings; the text ends before them
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: bool
    n: int | None  # choices sharing the prompt (seeded choice i = seed + i)
    beam_width: int | None  # >= 2: beam search (greedy), best n beams returned
    length_penalty: float | None
    early_stopping: bool
    repetition_penalty: float | None
    dola_layers: str | Sequence[int] | None  # "low", "high" or layer indices
    sled: bool
    sled_layers: str | Sequence[int] | None
    evolution_rate: float | None
    evolution_scale: int | None
    evolution_lower_bound: float | None
    disable_speculation: bool  # opt out of the server's speculative decoding
    request_id: str  # empty = the router assigns one
    model: str  # empty = the served model


def build_request(prompt: Prompt, **params: Unpack[GenerateParams]) -> generate_pb2.GenerateRequest:
    """A `GenerateRequest` for a text prompt or a list of token ids."""
    options = dict(params)
    request = generate_pb2.GenerateRequest(
        request_id=options.pop("request_id", ""), model=options.pop("model", "")
    )
    request.sampling.SetInParent()
    for name, value in options.items():
        if name not in GenerateParams.__annotations__:
            raise TypeError(f"unknown generation parameter {name!r}")
        if value is None:  # an unset proto3 optional means "server default"
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(request.sampling, name).extend(value)
        elif name in ("dola_layers", "sled_layers"):
            _set_layers(getattr(request.sampling, name), value)
        else:
            setattr(request.sampling, name, value)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _set_layers(selection: generate_pb2.LayerSelection, layers: str | Sequence[int]) -> None:
    if isinstance(layers, str):
        selection.preset = layers
    else:
        selection.indices.SetInParent()
        selection.indices.layers.extend(layers)


def channel_credentials(
    tls_ca: PemFile | None = None, tls_cert: PemFile | None = None, tls_key: PemFile | None = None
) -> grpc.ChannelCredentials:
    """TLS trusting `tls_ca` (default: the system's root CAs), presenting the client
    certificate `tls_cert` with its key `tls_key` when given (mutual TLS)."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")

    def read(path: PemFile | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(tls_ca), private_key=read(tls_key), certificate_chain=read(tls_cert)
    )


class _ClientBase:
    """Channel, stubs and call metadata, shared by both clients."""

    _insecure_channel: Any  # grpc.insecure_channel or grpc.aio.insecure_channel
    _secure_channel: Any  # grpc.secure_channel or grpc.aio.secure_channel

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        tls: bool = False,
        tls_ca: PemFile | None = None,
        tls_cert: PemFile | None = None,
        tls_key: PemFile | None = None,
    ) -> None:
        """TLS is on with `tls` or any `tls_*` file: `tls_ca` is the CA that signed the
        server's certificate (default: the system's roots), `tls_cert`/`tls_key` the client's
        certificate and key where the server requires one (mutual TLS)."""
        self.target = target
        self.timeout = timeout
        items = metadata.items() if isinstance(metadata, Mapping) else (metadata or ())
        self._metadata = [(key.lower(), value) for key, value in items]
        if api_key:
            self._metadata.append(("authorization", f"Bearer {api_key}"))
        if tls or tls_ca or tls_cert or tls_key:
            credentials = channel_credentials(tls_ca, tls_cert, tls_key)
            self._channel = type(self)._secure_channel(target, credentials, _CHANNEL_OPTIONS)
        else:
            self._channel = type(self)._insecure_channel(target, _CHANNEL_OPTIONS)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _call_metadata(self) -> list[tuple[str, str]]:
        """Fixed metadata plus the current span's trace context, read at call time."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # writes nothing when no span is current
        return self._metadata + sorted(carrier.items())


class GenerationClient(_ClientBase):
    """Blocking client with one channel; thread-safe. Use it as a context manager."""

    _insecure_channel = staticmethod(grpc.insecure_channel)
    _secure_channel = staticmethod(grpc.secure_channel)

    def generate_stream(
        self, prompt: Prompt, **params: Unpack[GenerateParams]
    ) -> Iterator[generate_pb2.GenerateResponse]:
        """Yields responses as tokens are produced; `close()` on the iterator cancels the RPC."""
        request = build_request(prompt, **params)
        # Metadata is taken now, not at the first next(), so the caller's span is the parent.
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._call_metadata())
        return self._iterate(call)

    @staticmethod
    def _iterate(call: Any) -> Iterator[generate_pb2.GenerateResponse]:
        try:
            yield from call
        except grpc.RpcError as error:
            raise GenerationError.from_rpc_error(error) from None
        finally:
            call.cancel()  # no-op when the stream already ended; stops the server otherwise

    def generate(self, prompt: Prompt, **params: Unpack[GenerateParams]) -> Completion:
        """Runs a generation to its end and returns the assembled `Completion`."""
        return Completion.from_responses(self.generate_stream(prompt, **params))

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The served model's token ids of `text` (with BOS etc. if `add_special_tokens`)."""
        request = generate_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._unary(self._stub.Tokenize, request).token_ids)

    def model_info(self) -> generate_pb2.ModelInfo:
        return self._unary(self._stub.GetModelInfo, generate_pb2.GetModelInfoRequest())

    def health(self, service: str = "") -> str:
        """The standard gRPC health status name, e.g. "SERVING"."""
        response = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def _unary(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self._call_metadata())
        except grpc.RpcError as error:
            raise GenerationError.from_rpc_error(error) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncGenerationClient(_ClientBase):
    """asyncio client (grpc.aio). Create and use it inside one running event loop."""

    _insecure_channel = staticmethod(grpc.aio.insecure_channel)
    _secure_channel = staticmethod(grpc.aio.secure_channel)

    def generate_stream(
        self, prompt: Prompt, **params: Unpack[GenerateParams]
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Async-iterates responses; cancelling the consumer or `aclose()` cancels the RPC."""
        request = build_request(prompt, **params)
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._call_metadata())
        return self._iterate(call)

    @staticmethod
    async def _iterate(call: Any) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as error:
            raise GenerationError.from_rpc_error(error) from None
        finally:
            call.cancel()

    async def generate(self, prompt: Prompt, **params: Unpack[GenerateParams]) -> Completion:
        """Runs a generation to its end and returns the assembled `Completion`."""
        return await collect(self.generate_stream(prompt, **params))

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        request = generate_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._unary(self._stub.Tokenize, request)).token_ids)

    async def model_info(self) -> generate_pb2.ModelInfo:
        return await self._unary(self._stub.GetModelInfo, generate_pb2.GetModelInfoRequest())

    async def health(self, service: str = "") -> str:
        """The standard gRPC health status name, e.g. "SERVING"."""
        response = await self._unary(
            self._health.Check, health_pb2.HealthCheckRequest(service=service)
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout, metadata=self._call_metadata())
        except grpc.aio.AioRpcError as error:
            raise GenerationError.from_rpc_error(error) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def collect(responses: AsyncIterable[generate_pb2.GenerateResponse]) -> Completion:
    """Assembles a `Completion` from an async stream of responses."""
    completion = Completion()
    async for response in responses:
        completion.add(response)
    return completion
