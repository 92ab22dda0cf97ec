"""`ServingApp`: everything behind `pdserve serve` (Ray, Redis, the worker pools, the router's
servers), started in order; it owns what it started and stops it in reverse order."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import metrics, telemetry
from pdserve.app.http_api import start_http_api
from pdserve.app.planning import start_planner, start_role_switching
from pdserve.app.startup_steps import (
    api_credentials,
    as_async,
    bind_port,
    bind_port_async,
    env_list,
    kill_workers,
    metrics_tls,
    off_loop,
    random_secret,
)
from pdserve.app.stats_listeners import export_worker_stats, store_speculation_counts
from pdserve.config import ServeConfig
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.maintenance import IndexMaintenance
from pdserve.ray_cluster import join_ray, start_private_ray, stop_ray
from pdserve.startup_checks import (
    StartupError,
    check_ports_free,
    check_ray_reachable,
    check_speculation,
    load_chat_template,
    load_model_limits,
)
from pdserve.startup_progress import StartupProgress, weights_size
from router.generation_service import GenerationService
from router.observability import RequestObserver
from router.policy import RoutingPolicy
from router.request_flow import RequestFlow
from router.routing import Routing
from router.server import RouterServer
from router.tokenizing import BackgroundTokenizer
from router.validation import max_request_bytes
from router.worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)


@dataclass
class ServingApp:
    config: ServeConfig
    port: int = 0
    metrics_port: int | None = None  # the bound Prometheus port, when config.metrics_port is set
    http_port: int = 0  # the bound port of the OpenAI-compatible HTTP API
    advertise_redis_url: bool = False  # write the private Redis URL for `pdserve stats`
    planner: object | None = None  # router.online_plan.OnlinePlanner with --plan-interval
    role_switcher: object | None = None  # router.role_switch.RoleSwitcher, --role-switching
    # Start-up's lines (`pdserve serve` prints them; embedded apps stay quiet), and whether
    # Ray's own INFO lines show too (--log-level INFO or DEBUG).
    progress: StartupProgress = field(default_factory=StartupProgress.silent)
    verbose_ray: bool = False
    # Called on the event loop once Ray is up: ray.init replaces the process's SIGTERM handler
    # with its own (a C++ one that aborts), so `pdserve serve` installs its own again here.
    after_ray_started: Callable[[], None] | None = None
    _ready: bool = True
    _started_workers: dict[str, int] = field(default_factory=dict)  # role -> healthy so far
    _stack: list = field(default_factory=list)  # (description, async stop callable), LIFO

    async def start(self) -> None:
        import ray

        from pdserve.models.builtin import default_model_dir
        from pdserve.worker.pools import create_workers

        config = self.config
        progress = self.progress
        telemetry.setup_tracing("pdserve-router")
        # Resolve (and on first use, write) the built-in model here once, before the actors
        # start; each worker still resolves it itself (config.engine.model stays None), so a
        # worker on another node writes its own identical copy instead of needing this path.
        model_dir = Path(config.engine.model or default_model_dir())
        # Mistakes in the settings surface here, in seconds, before Ray and the workers start.
        tokenizer, limits = load_model_limits(model_dir, config.engine)
        check_speculation(config, limits.vocab_size)
        check_ports_free(config)
        chat_template = load_chat_template(model_dir)
        dtypes = await off_loop(self._check_dtypes)  # imports torch: seconds
        if not ray.is_initialized():
            check_ray_reachable(config.ray_address)
        progress.phase(f"settings and ports checked{dtypes}")
        if config.metrics_port is not None:
            self.metrics_port = bind_port(
                config.metrics_port,
                "--metrics-port",
                lambda: metrics.start_metrics_server(
                    config.metrics_port, config.metrics_host, metrics_tls(config)
                ),
            )
            self._stack.append(
                ("metrics", as_async(lambda: metrics.stop_metrics_server(self.metrics_port)))
            )
            log.info("Prometheus metrics on port %d", self.metrics_port)
        config.kv.secret = (
            config.kv.secret or os.environ.get("PDSERVE_KV_SECRET") or (random_secret())
        )
        if not ray.is_initialized():
            await off_loop(self._start_ray)
            if self.after_ray_started is not None:
                self.after_ray_started()
        redis_url = config.redis_url or await self._start_private_redis()
        progress.phase(
            f"model {model_dir.name} ({weights_size(model_dir)} of weights): loading in "
            f"{config.prefill_workers} prefill and {config.decode_workers} decode workers"
        )
        prefill, decode = create_workers(config, redis_url)
        self._stack.append(("workers", as_async(lambda: kill_workers(ray, {**prefill, **decode}))))
        # A stats poll waits for the worker's current engine step: a simulated one lasts its
        # modelled time x --sim-time-scale, so the poll is given as long as progress is.
        hybrid = config.router.hybrid  # the decode actors serve both roles
        self.pool = WorkerPool.of_ray_actors(
            prefill,
            {} if hybrid else decode,
            decode if hybrid else None,
            call_timeout_s=max(5.0, config.router.progress_timeout_s),
            heartbeat_timeout_s=config.router.heartbeat_timeout_s,
        )
        speculates = config.engine_for("decode").speculative.enabled
        export_worker_stats(self.pool, model_dir.name, speculates)
        self._stack.append(("pool", self.pool.stop))
        await self.pool.start(on_ready=self._worker_started)
        if not self.pool.of_role("decode"):
            raise StartupError(f"no decode worker started: {self.pool.why_unavailable('decode')}")

        index = PrefixIndex(
            redis_url, model_dir.name, config.engine.block_size, mirror=config.router.index_mirror
        )
        self._stack.append(("prefix index", index.aclose))  # its queued writes first

        store_speculation_counts(self.pool, index)
        self._stack.append(("index maintenance", as_async(IndexMaintenance(index).start().stop)))
        policy = RoutingPolicy(config.router, seed=config.router.policy_seed)
        # Waiting prompts are packed into engine steps of this many tokens (queue estimates).
        policy.cost.step_tokens = config.engine.max_num_batched_tokens
        self.planner = start_planner(config, model_dir, self.pool, policy, index)
        if self.planner is not None:
            self._stack.append(("online planner", self.planner.stop))
        self.routing = Routing(
            self.pool,
            policy,
            config.engine.block_size,
            index,
            decode_caches_received_kv=config.kv.caches_received_kv,
        )
        self.role_switcher = start_role_switching(config, self.pool, self.routing, self.planner)
        if self.role_switcher is not None:
            self._stack.append(("role switching", self.role_switcher.stop))
        flow = RequestFlow(
            self.pool,
            self.routing.choose_async,
            tokenizer,
            max_retries=config.router.max_retries,
            progress_timeout_s=config.router.progress_timeout_s,
            on_prefill_done=self.routing.on_prefill_done,
            on_prompt_computed=self.routing.on_prompt_computed,
            on_output_computed=self.routing.on_output_computed,
            block_size=config.engine.block_size,
        )
        # Stopped after both servers drain, before the workers: what still runs is ended.
        self._stack.append(("request flow", flow.close))
        self.routing.count(flow.waiting_for_room)  # admission control counts them
        info = {"block_size": config.engine.block_size, "kv_transport": config.kv.transport}
        api_keys = config.router.api_keys or env_list("PDSERVE_API_KEYS")
        if config.router.max_prompt_bytes:  # else the context's worth (ModelLimits)
            limits.max_prompt_bytes = config.router.max_prompt_bytes
        tokenizing = BackgroundTokenizer(tokenizer)
        self.routing.count(tokenizing.pool)  # admission control counts its queue
        service = GenerationService(flow, tokenizing, limits, info, RequestObserver())
        service.worker_counts = lambda: (
            len(self.pool.of_role("prefill")),
            len(self.pool.of_role("decode")),
        )
        self.server = bind_port(
            config.router.port,
            "--port",
            lambda: RouterServer(
                service,
                config.router.host,
                config.router.port,
                interceptors=telemetry.aio_server_interceptors(),
                api_keys=api_keys,
                credentials=api_credentials(config.router),
                max_receive_bytes=max_request_bytes(limits),
                shutdown_grace_s=config.router.shutdown_grace_s,
                health_port=config.router.health_port,
            ),
        )
        await bind_port_async(config.router.port, "--port", self.server.start)
        self._stack.append(("server", self.server.stop))
        # Last to stop: spans of the final requests still leave before the process does.
        self._stack.insert(0, ("tracing", as_async(telemetry.flush_tracing)))
        self.port = self.server.port
        self.pool.health_listeners.append(self._track_readiness)
        self.http_port = await start_http_api(
            config.router,
            flow,
            tokenizer,
            limits,
            chat_template,
            redis_url,
            self.routing,
            self.server.auth,
            self._is_ready,
            self._unready_reason,
            self._stack,
        )

    def _check_dtypes(self) -> str:
        """Tries each pool's dtype on its device (pdserve.dtype_probe) when the workers run on
        this machine (a local Ray); returns the note for the start-up line, e.g. "; float32
        runs on cpu"."""
        config = self.config
        if config.ray_address:
            return ""
        from pdserve.dtype_probe import check_dtype

        tried = []
        for role in ("prefill", "decode"):
            engine = config.engine_for(role)
            count = getattr(config, f"{role}_workers")
            if count and engine.kind == "torch" and (engine.dtype, engine.device) not in tried:
                check_dtype(engine.dtype, engine.device)
                tried.append((engine.dtype, engine.device))
        return "".join(f"; {dtype} runs on {device}" for dtype, device in tried)

    def _start_ray(self) -> None:
        import ray

        config = self.config
        if config.ray_address:
            join_ray(config)
            self._stack.append(("ray", stop_ray))
            self.progress.phase(f"joined the Ray cluster at {config.ray_address}")
            return
        start_private_ray(config, self.verbose_ray)
        self._stack.append(("ray", stop_ray))
        cpus = ray.cluster_resources().get("CPU", 0)
        self.progress.phase(f"Ray started (private to this server, {cpus:g} CPUs)")

    def _worker_started(self, worker: Worker, info: dict | None) -> None:
        """Start-up's line for each worker as it becomes healthy or fails to."""
        role = worker.role
        total = len(self.pool.of_role(role, healthy_only=False))
        if info is None:
            reason = self.pool.failures.get(worker.worker_id, "")
            self.progress.worker_done(f"{role} worker {worker.worker_id} {reason}")
            return
        self._started_workers[role] = self._started_workers.get(role, 0) + 1
        self.progress.worker_done(f"{role} worker {self._started_workers[role]}/{total} healthy")

    def _is_ready(self) -> bool:
        """A decode worker can take requests: healthy, its engine steps not failing."""
        return bool(self.pool.usable("decode"))

    def _unready_reason(self) -> str:
        return self.pool.why_unavailable("decode")

    def _track_readiness(self) -> None:
        ready = self._is_ready()
        if ready != self._ready:
            self._ready = ready
            asyncio.ensure_future(self.server.set_ready(ready))

    async def _start_private_redis(self) -> str:
        from pdserve.prefix_index import local_servers
        from pdserve.prefix_index.redis_server import RedisServer

        # Supervised: if it dies it comes back on the same port and password, and the
        # router's and workers' links recover on their own.
        server = RedisServer(supervise=True)
        await off_loop(server.start)  # waits until it answers, seconds on a busy machine
        self.redis_server = server  # tests stop and restart it to check outage recovery
        self._stack.append(("redis", as_async(server.close)))
        self.progress.phase(f"Redis started on {server.host}:{server.port} (private)")
        if self.advertise_redis_url:
            # `pdserve serve` notes the URL so `pdserve stats` finds its private server without
            # flags; embedded apps (tests, benchmarks) leave the user's notes alone.
            note = local_servers.advertise(server.url, self.config.router.port)
            self._stack.append(("redis url note", as_async(lambda: local_servers.withdraw(note))))
        return server.url

    async def stop(self) -> None:
        while self._stack:
            name, stop = self._stack.pop()
            try:
                await stop()
            except Exception:
                log.exception("stopping %s failed", name)
