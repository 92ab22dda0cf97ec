"""A real gRPC server with a tiny echo implementation of `pdserve.v1.Generation`.

It is a fixture for the client and the load generator (it answers quickly and records what it
saw: metadata, requests, cancellations), not a stand-in for the router, which is tested against
real workers elsewhere.

Generation echoes the prompt's token ids cyclically, `tokens_per_chunk` per response, sleeping
`first_token_delay_s` before the first response and `token_delay_s` between the others. The text
of token `t` is `"<t>"`. Text prompts are tokenized one id per whitespace-separated word. A text
prompt starting with "fail" is rejected with INVALID_ARGUMENT; an API key, when configured, is
checked (UNAUTHENTICATED otherwise).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.pb import generate_pb2, generate_pb2_grpc

VOCAB_SIZE = 1000
EOS_TOKEN_ID = 0


def word_ids(text: str) -> list[int]:
    """The echo tokenizer: one id per word, never the EOS id."""
    return [1 + sum(word.encode()) % (VOCAB_SIZE - 1) for word in text.split()]


@dataclass
class EchoServicer(generate_pb2_grpc.GenerationServicer):
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    tokens_per_chunk: int = 1
    api_key: str | None = None
    # What the server saw, for assertions.
    requests: list[generate_pb2.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    cancelled_event: threading.Event = field(default_factory=threading.Event)

    def Generate(self, request, context) -> Iterator[generate_pb2.GenerateResponse]:
        metadata = dict(context.invocation_metadata())
        self.requests.append(request)
        self.metadata.append(metadata)
        if self.api_key and metadata.get("authorization") != f"Bearer {self.api_key}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        if request.WhichOneof("prompt") == "text" and request.text.startswith("fail"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt asked to fail")
        prompt = (
            list(request.token_ids.ids) if request.HasField("token_ids") else word_ids(request.text)
        )
        request_id = request.request_id or f"echo-{len(self.requests)}"
        state = {"done": False}
        context.add_callback(lambda: self._on_termination(request_id, state))
        yield from self._stream(request, prompt, request_id)
        state["done"] = True

    def _on_termination(self, request_id: str, state: dict[str, bool]) -> None:
        if not state["done"]:  # the RPC ended before the handler finished: cancelled
            self.cancelled.append(request_id)
            self.cancelled_event.set()

    def _stream(self, request, prompt: list[int], request_id: str):
        sampling = request.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 64
        output = [prompt[i % len(prompt)] for i in range(max_tokens)]
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else {EOS_TOKEN_ID})
        finish = generate_pb2.FINISH_REASON_LENGTH
        for i, token in enumerate(output):
            if token in stops:
                output, finish = output[: i + 1], generate_pb2.FINISH_REASON_STOP
                break
        time.sleep(self.first_token_delay_s)
        timings = generate_pb2.Timings(ttft_ms=1.0, prefill_worker="prefill-0")
        for start in range(0, len(output), self.tokens_per_chunk):
            if start:
                time.sleep(self.token_delay_s)
            chunk = output[start : start + self.tokens_per_chunk]
            response = generate_pb2.GenerateResponse(
                request_id=request_id,
                token_ids=chunk,
                text="".join(f"<{t}>" for t in chunk),
                logprobs=[-0.5] * len(chunk) if sampling.logprobs else [],
                timings=timings if start == 0 else None,
            )
            if start + self.tokens_per_chunk >= len(output):
                response.finish_reason = finish
                response.usage.CopyFrom(
                    generate_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=len(output))
                )
                response.timings.CopyFrom(
                    generate_pb2.Timings(
                        ttft_ms=1.0,
                        e2e_ms=2.0,
                        prefill_worker="prefill-0",
                        decode_worker="decode-0",
                    )
                )
            yield response

    def Tokenize(self, request, context) -> generate_pb2.TokenizeResponse:
        return generate_pb2.TokenizeResponse(
            token_ids=word_ids(request.text), tokens=request.text.split()
        )

    def GetModelInfo(self, request, context) -> generate_pb2.ModelInfo:
        return generate_pb2.ModelInfo(
            name="echo",
            vocab_size=VOCAB_SIZE,
            max_model_len=4096,
            block_size=16,
            eos_token_ids=[EOS_TOKEN_ID],
        )


class EchoServer:
    """Runs an `EchoServicer` (plus gRPC health) on 127.0.0.1:<ephemeral>; a context manager."""

    def __init__(self, servicer: EchoServicer | None = None, max_workers: int = 64) -> None:
        self.servicer = servicer or EchoServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
        generate_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self._server)
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    def __enter__(self) -> EchoServer:
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.stop(grace=None)
