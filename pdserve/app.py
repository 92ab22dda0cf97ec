"""Everything behind `pdserve serve`: Ray, Redis, the worker pools and the router server.

`ServingApp` owns what it started and stops it in reverse order. `BackgroundApp` runs one on its
own event loop thread, for tests and benchmarks that drive it with ordinary gRPC clients.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import metrics, telemetry
from pdserve.config import ServeConfig
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.tokenizer import Tokenizer
from router.generation_service import GenerationService
from router.observability import RequestObserver
from router.policy import RoutingPolicy
from router.request_flow import RequestFlow
from router.routing import Routing
from router.server import RouterServer
from router.validation import ModelLimits
from router.worker_pool import WorkerPool

log = logging.getLogger(__name__)


def model_limits(model_dir: Path, max_model_len: int | None, tokenizer: Tokenizer) -> ModelLimits:
    config = json.loads((model_dir / "config.json").read_text())
    context = config.get("max_position_embeddings", 2048)
    return ModelLimits(
        name=model_dir.name,
        vocab_size=int(config["vocab_size"]),
        max_model_len=min(max_model_len or context, context),
        eos_token_ids=list(tokenizer.eos_token_ids),
    )


@dataclass
class ServingApp:
    config: ServeConfig
    port: int = 0
    metrics_port: int | None = None  # the bound Prometheus port, when config.metrics_port is set
    advertise_redis_url: bool = False  # write the private Redis URL for `pdserve stats`
    _ready: bool = True
    _stack: list = field(default_factory=list)  # (description, async stop callable), LIFO

    async def start(self) -> None:
        import ray

        from pdserve.models.builtin import default_model_dir
        from pdserve.worker.pools import create_workers

        config = self.config
        telemetry.setup_tracing("pdserve-router")
        if config.metrics_port is not None:
            self.metrics_port = metrics.start_metrics_server(config.metrics_port)
            self._stack.append(
                ("metrics", _async(lambda: metrics.stop_metrics_server(self.metrics_port)))
            )
            log.info("Prometheus metrics on port %d", self.metrics_port)
        # Resolve (and on first use, write) the built-in model here once, before the actors
        # start; each worker still resolves it itself (config.engine.model stays None), so a
        # worker on another node writes its own identical copy instead of needing this path.
        model_dir = Path(config.engine.model or default_model_dir())
        config.kv.secret = (
            config.kv.secret or os.environ.get("PDSERVE_KV_SECRET") or (_random_secret())
        )
        redis_url = config.redis_url or await self._start_private_redis()
        if not ray.is_initialized():
            ray.init(address=config.ray_address, **_local_ray_args(config))
            self._stack.append(("ray", _async(ray.shutdown)))
        prefill, decode = create_workers(config, redis_url)
        self._stack.append(("workers", _async(lambda: _kill(ray, {**prefill, **decode}))))
        self.pool = WorkerPool(prefill, decode)
        # Every worker's gauges, as of the latest poll (the router's endpoint shows them all).
        self.pool.stats_listeners.append(lambda w, old, stats: metrics.observe_worker_stats(stats))
        await self.pool.start()
        self._stack.append(("pool", self.pool.stop))

        tokenizer = Tokenizer.from_dir(model_dir)
        limits = model_limits(model_dir, config.engine.max_model_len, tokenizer)
        index = PrefixIndex(redis_url, model_dir.name, config.engine.block_size)
        policy = RoutingPolicy(config.router)
        # Waiting prompts are packed into engine steps of this many tokens (queue estimates).
        policy.cost.step_tokens = config.engine.max_num_batched_tokens
        self.routing = Routing(self.pool, policy, config.engine.block_size, index)
        flow = RequestFlow(
            self.pool,
            self.routing.choose,
            config.router.max_retries,
            on_prefill_done=self.routing.on_prefill_done,
            block_size=config.engine.block_size,
        )
        info = {"block_size": config.engine.block_size, "kv_transport": config.kv.transport}
        api_keys = config.router.api_keys or _env_list("PDSERVE_API_KEYS")
        service = GenerationService(flow, tokenizer, limits, info, api_keys, RequestObserver())
        service.worker_counts = lambda: (
            len(self.pool.of_role("prefill")),
            len(self.pool.of_role("decode")),
        )
        self.server = RouterServer(
            service,
            config.router.host,
            config.router.port,
            interceptors=telemetry.aio_server_interceptors(),
        )
        await self.server.start()
        self._stack.append(("server", self.server.stop))
        # Last to stop: spans of the final requests still leave before the process does.
        self._stack.insert(0, ("tracing", _async(telemetry.flush_tracing)))
        self.port = self.server.port
        self.pool.round_listeners.append(self._track_readiness)

    def _track_readiness(self) -> None:
        ready = bool(self.pool.of_role("decode"))
        if ready != self._ready:
            self._ready = ready
            asyncio.ensure_future(self.server.set_ready(ready))

    async def _start_private_redis(self) -> str:
        from pdserve.prefix_index.redis_server import LOCAL_URL_FILE, RedisServer

        # `pdserve serve` writes the URL file so `pdserve stats` finds its private server
        # without flags; embedded apps (tests, benchmarks) leave the user's file alone.
        server = RedisServer(url_file=LOCAL_URL_FILE if self.advertise_redis_url else None)
        server.start()
        self.redis_server = server  # tests stop and restart it to check outage recovery
        self._stack.append(("redis", _async(server.close)))
        log.info("started a private redis-server at %s", server.url)
        return server.url

    async def stop(self) -> None:
        while self._stack:
            name, stop = self._stack.pop()
            try:
                await stop()
            except Exception:
                log.exception("stopping %s failed", name)


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

    def __exit__(self, *exc) -> None:
        self.run(self.app.stop(), timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def _local_ray_args(config: ServeConfig) -> dict:
    if config.ray_address:
        return {}
    # A local Ray advertises both pools itself, sized to the requested workers.
    return {
        "resources": {
            config.prefill_pool_resource: max(config.prefill_workers, 1),
            config.decode_pool_resource: max(config.decode_workers, 1),
        },
        "include_dashboard": False,
        "log_to_driver": True,
    }


def _kill(ray, handles: dict) -> None:
    for handle in handles.values():
        ray.kill(handle, no_restart=True)


def _async(fn):
    async def call():
        fn()

    return call


def _random_secret() -> str:
    import secrets

    return secrets.token_urlsafe(32)


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]
