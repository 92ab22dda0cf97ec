"""The router's client-facing server with no workers behind it, on its own event-loop thread.

Everything the API edge does before a request reaches the workers (authentication, request
decoding, validation, Tokenize, GetModelInfo, health, TLS, draining) runs here for real.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from pdserve.models.tokenizer_builder import write_tokenizer
from pdserve.tokenizer import Tokenizer
from router.generation_service import GenerationService
from router.server import RouterServer
from router.tokenizing import BackgroundTokenizer
from router.validation import ModelLimits, max_request_bytes

VOCAB = 512


def model_limits(max_prompt_bytes: int = 4 << 20) -> ModelLimits:
    return ModelLimits("tiny", VOCAB, 2048, [1], max_prompt_bytes=max_prompt_bytes)


class ApiServer:
    """`with ApiServer(tmp_path, api_keys=[...]) as server: server.target`"""

    def __init__(self, directory: Path, limits: ModelLimits | None = None, **server_args) -> None:
        write_tokenizer(directory, VOCAB)
        self.limits = limits or model_limits()
        tokenizer = BackgroundTokenizer(Tokenizer.from_dir(directory))
        # No RequestFlow: a request that passes validation would fail with INTERNAL.
        self.service = GenerationService(None, tokenizer, self.limits, {"block_size": 16})
        server_args.setdefault("max_receive_bytes", max_request_bytes(self.limits))
        self._server_args = server_args
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ApiServer:
        self._thread.start()
        self.server = self.run(self._start())
        self.target = f"127.0.0.1:{self.server.port}"
        return self

    async def _start(self) -> RouterServer:
        server = RouterServer(self.service, "127.0.0.1", 0, **self._server_args)
        await server.start()
        return server

    def stop(self, grace_s: float | None = None) -> None:
        self.run(self.server.stop(grace_s))

    def __exit__(self, *exc) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
