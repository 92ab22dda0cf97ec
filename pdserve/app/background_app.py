"""`BackgroundApp`: a ServingApp on its own event-loop thread, for tests and benchmarks that drive
it with ordinary gRPC clients."""

from __future__ import annotations

import asyncio
import threading

from pdserve.app.serving_app import ServingApp
from pdserve.config import ServeConfig


class BackgroundApp:
    """A ServingApp on its own event-loop thread: `with BackgroundApp(config) as app: app.port`."""

    def __init__(self, config: ServeConfig) -> None:
        self.app = ServingApp(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> BackgroundApp:
        self._thread.start()
        try:
            self.run(self.app.start(), timeout=600)
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def port(self) -> int:
        return self.app.port

    @property
    def http_port(self) -> int:
        return self.app.http_port

    def __exit__(self, *exc) -> None:
        self.run(self.app.stop(), timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
