"""Everything behind `pdserve serve`: Ray, Redis, the worker pools and the router server.

`ServingApp` owns what it started and stops it in reverse order. `BackgroundApp` runs one on its
own event loop thread, for tests and benchmarks that drive it with ordinary gRPC clients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import metrics, telemetry
from pdserve.config import RouterConfig, ServeConfig
from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.maintenance import IndexMaintenance
from pdserve.prefix_index.spec_stats import record_speculation
from pdserve.ray_cluster import join_ray, start_private_ray
from pdserve.startup_checks import (
    StartupError,
    check_ports_free,
    check_ray_reachable,
    check_speculation,
    load_chat_template,
    load_model_limits,
    port_in_use,
)
from pdserve.startup_progress import StartupProgress, weights_size
from pdserve.tls_files import CertificateFiles
from pdserve.tokenizer import Tokenizer
from router.generation_service import GenerationService
from router.http.chat_template import ChatTemplate
from router.observability import RequestObserver
from router.policy import RoutingPolicy
from router.request_flow import RequestFlow
from router.routing import Routing
from router.server import RouterServer
from router.tls import server_credentials
from router.tokenizing import BackgroundTokenizer
from router.validation import ModelLimits, max_request_bytes
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
        dtypes = await _off_loop(self._check_dtypes)  # imports torch: seconds
        if not ray.is_initialized():
            check_ray_reachable(config.ray_address)
        progress.phase(f"settings and ports checked{dtypes}")
        if config.metrics_port is not None:
            self.metrics_port = _bind(
                config.metrics_port,
                "--metrics-port",
                lambda: metrics.start_metrics_server(
                    config.metrics_port, config.metrics_host, _metrics_tls(config)
                ),
            )
            self._stack.append(
                ("metrics", _async(lambda: metrics.stop_metrics_server(self.metrics_port)))
            )
            log.info("Prometheus metrics on port %d", self.metrics_port)
        config.kv.secret = (
            config.kv.secret or os.environ.get("PDSERVE_KV_SECRET") or (_random_secret())
        )
        if not ray.is_initialized():
            await _off_loop(self._start_ray)
            if self.after_ray_started is not None:
                self.after_ray_started()
        redis_url = config.redis_url or await self._start_private_redis()
        progress.phase(
            f"model {model_dir.name} ({weights_size(model_dir)} of weights): loading in "
            f"{config.prefill_workers} prefill and {config.decode_workers} decode workers"
        )
        prefill, decode = create_workers(config, redis_url)
        self._stack.append(("workers", _async(lambda: _kill(ray, {**prefill, **decode}))))
        # A stats poll waits for the worker's current engine step: a simulated one lasts its
        # modelled time x --sim-time-scale, so the poll is given as long as progress is.
        self.pool = WorkerPool.of_ray_actors(
            prefill,
            decode,
            call_timeout_s=max(5.0, config.router.progress_timeout_s),
            heartbeat_timeout_s=config.router.heartbeat_timeout_s,
        )
        # Every worker's gauges, as of the latest poll (the router's endpoint shows them all).
        self.pool.stats_listeners.append(
            lambda w, old, stats: metrics.observe_worker_stats(stats, old)
        )
        self._observe_speculation(model_dir.name)
        # The served model's load under vLLM's names (vllm:num_requests_running, ...).
        self.pool.stats_listeners.append(
            lambda w, old, stats: metrics.observe_model_load(
                model_dir.name, [x.stats for x in self.pool.workers.values() if x.stats]
            )
        )
        self._stack.append(("pool", self.pool.stop))
        await self.pool.start(on_ready=self._worker_started)
        if not self.pool.of_role("decode"):
            raise StartupError(f"no decode worker started: {self.pool.why_unavailable('decode')}")

        index = PrefixIndex(
            redis_url, model_dir.name, config.engine.block_size, mirror=config.router.index_mirror
        )
        self._stack.append(("prefix index", index.aclose))  # its queued writes first

        def speculation_counts(worker, old, stats) -> None:
            """`pdserve stats` reads the speculation counts from the index's Redis (written off
            the event loop, which runs the pool's polls)."""
            counts = metrics.speculation_delta(old, stats)
            if any(counts):
                args = (index.link, index.keys, worker.worker_id, counts)
                index.in_background(record_speculation, *args)

        self.pool.stats_listeners.append(speculation_counts)
        self._stack.append(("index maintenance", _async(IndexMaintenance(index).start().stop)))
        policy = RoutingPolicy(config.router)
        # Waiting prompts are packed into engine steps of this many tokens (queue estimates).
        policy.cost.step_tokens = config.engine.max_num_batched_tokens
        self._start_planner(model_dir, policy, index)
        self.routing = Routing(
            self.pool,
            policy,
            config.engine.block_size,
            index,
            decode_caches_received_kv=config.kv.caches_received_kv,
        )
        self._start_role_switching()
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
        api_keys = config.router.api_keys or _env_list("PDSERVE_API_KEYS")
        if config.router.max_prompt_bytes:  # else the context's worth (ModelLimits)
            limits.max_prompt_bytes = config.router.max_prompt_bytes
        tokenizing = BackgroundTokenizer(tokenizer)
        self.routing.count(tokenizing.pool)  # admission control counts its queue
        service = GenerationService(flow, tokenizing, limits, info, RequestObserver())
        service.worker_counts = lambda: (
            len(self.pool.of_role("prefill")),
            len(self.pool.of_role("decode")),
        )
        self.server = _bind(
            config.router.port,
            "--port",
            lambda: RouterServer(
                service,
                config.router.host,
                config.router.port,
                interceptors=telemetry.aio_server_interceptors(),
                api_keys=api_keys,
                credentials=_api_credentials(config.router),
                max_receive_bytes=max_request_bytes(limits),
                shutdown_grace_s=config.router.shutdown_grace_s,
                health_port=config.router.health_port,
            ),
        )
        await _bind_async(config.router.port, "--port", self.server.start)
        self._stack.append(("server", self.server.stop))
        # Last to stop: spans of the final requests still leave before the process does.
        self._stack.insert(0, ("tracing", _async(telemetry.flush_tracing)))
        self.port = self.server.port
        self.pool.health_listeners.append(self._track_readiness)
        await self._start_http(flow, tokenizer, limits, chat_template, redis_url)

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
            self._stack.append(("ray", _async(ray.shutdown)))
            self.progress.phase(f"joined the Ray cluster at {config.ray_address}")
            return
        start_private_ray(config, self.verbose_ray)
        self._stack.append(("ray", _async(ray.shutdown)))
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

    def _start_planner(self, model_dir: Path, policy: RoutingPolicy, index: PrefixIndex) -> None:
        """--plan-interval: the online planner over this router's traffic and measured costs."""
        router = self.config.router
        if not router.plan_interval_s:
            return
        from router.online_plan import OnlinePlanner, PlanSettings

        engine = self.config.engine_for("decode")
        settings = PlanSettings(
            model_dir=str(model_dir),
            block_size=engine.block_size,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            dtype=engine.dtype,
            ttft_slo_ms=router.ttft_slo_ms,
            tpot_slo_ms=router.tpot_slo_ms,
        )
        self.planner = OnlinePlanner(
            router.plan_interval_s,
            settings,
            policy.cost,
            lambda: [w.stats for w in self.pool.workers.values() if w.stats],
            publish=lambda plan: index.in_background(index.publish_plan, plan),  # off the loop
        ).start()
        self._stack.append(("online planner", self.planner.stop))

    def _start_role_switching(self) -> None:
        """--role-switching: workers move between roles towards the online planner's split."""
        router = self.config.router
        if not router.role_switching:
            return
        from router.role_hysteresis import RoleHysteresis
        from router.role_switch import RoleSwitcher

        self.role_switcher = RoleSwitcher(
            self.pool,
            self.routing.roles_changed,
            RoleHysteresis(router.role_switch_dwell_s, router.role_switch_margin),
            router.role_switch_drain_s,
        )
        self.planner.listeners.append(self.role_switcher.on_plan)
        self._stack.append(("role switching", self.role_switcher.stop))

    async def _start_http(
        self,
        flow: RequestFlow,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        chat_template: ChatTemplate | None,
        redis_url: str,
    ) -> None:
        """The OpenAI-compatible HTTP API beside gRPC: the same flow, limits and API keys; the
        Responses API's stored responses in the prefix index's Redis."""
        from router.http.api import create_app
        from router.http.response_store import ResponseStore
        from router.http.server import HttpServer
        from router.http.service import OpenAIService

        router = self.config.router
        service = OpenAIService(
            flow,
            BackgroundTokenizer(tokenizer),
            limits,
            RequestObserver(),
            chat_template,
            router.stream_one_token_per_event,
        )
        response_store = ResponseStore(redis_url, router.response_ttl_s, router.response_max_bytes)
        self._stack.append(("response store", response_store.aclose))
        for queue in (service.tokenizer.pool, service.cpu):  # admission control counts them
            self.routing.count(queue)
        metrics.track_router_pending(self.routing.pending_stages())
        http = HttpServer(
            create_app(
                service, self.server.auth, self._is_ready, self._unready_reason, response_store
            ),
            router.http_host,
            router.http_port,
            tls_cert=router.tls_cert,
            tls_key=router.tls_key,
            tls_client_ca=router.tls_client_ca,
        )
        await _bind_async(router.http_port, "--http-port", http.start)
        self._stack.append(
            ("http server", lambda: _stop_http(http, service, router.shutdown_grace_s))
        )
        self.http_port = http.port

    def _observe_speculation(self, model: str) -> None:
        """The served model's speculative decoding counters under vLLM's names; they exist (at
        0) from the start when the decode pool speculates, as vLLM's do."""
        if self.config.engine_for("decode").speculative.enabled:
            for counter in metrics.MODEL_SPEC_COUNTERS:
                counter.labels(model)
        self.pool.stats_listeners.append(
            lambda w, old, stats: metrics.observe_model_speculation(model, old, stats)
        )

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
        await _off_loop(server.start)  # waits until it answers, seconds on a busy machine
        self.redis_server = server  # tests stop and restart it to check outage recovery
        self._stack.append(("redis", _async(server.close)))
        self.progress.phase(f"Redis started on {server.host}:{server.port} (private)")
        if self.advertise_redis_url:
            # `pdserve serve` notes the URL so `pdserve stats` finds its private server without
            # flags; embedded apps (tests, benchmarks) leave the user's notes alone.
            note = local_servers.advertise(server.url, self.config.router.port)
            self._stack.append(("redis url note", _async(lambda: local_servers.withdraw(note))))
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

    @property
    def http_port(self) -> int:
        return self.app.http_port

    def __exit__(self, *exc) -> None:
        self.run(self.app.stop(), timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def _stop_http(http, service, grace_s: float) -> None:
    await http.stop(grace_s)
    service.close()


# Start-up's slow steps run here, off the event loop, so that Ctrl-C (which cancels start-up)
# is seen at once. One thread for the life of the process: Ray's processes get SIGKILL when
# the thread that started them ends (PR_SET_PDEATHSIG, Ray's fate sharing).
_STARTUP_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdserve-startup")


async def _off_loop(fn):
    return await asyncio.get_running_loop().run_in_executor(_STARTUP_THREAD, fn)


def _bind(port: int, flag: str, bind):
    """bind()'s result; a port taken since check_ports_free (or one it could not see) is
    the same one line."""
    try:
        return bind()
    except (OSError, RuntimeError) as e:
        raise StartupError(port_in_use(port, flag)) from e


async def _bind_async(port: int, flag: str, bind) -> None:
    try:
        await bind()
    except (OSError, RuntimeError) as e:
        raise StartupError(port_in_use(port, flag)) from e


def _kill(ray, handles: dict) -> None:
    from pdserve.worker.pools import release_rank_groups

    for handle in handles.values():
        ray.kill(handle, no_restart=True)
    release_rank_groups()  # TP workers' placement groups, once their ranks are gone


def _async(fn):
    async def call():
        fn()

    return call


def _random_secret() -> str:
    import secrets

    return secrets.token_urlsafe(32)


def _api_credentials(router: RouterConfig):
    if not router.tls_cert:
        return None
    return server_credentials(router.tls_cert, router.tls_key, router.tls_client_ca)


def _metrics_tls(config: ServeConfig) -> CertificateFiles | None:
    """--metrics-tls: the client API's certificate and client CA on the metrics port too."""
    if not config.metrics_tls:
        return None
    router = config.router
    return CertificateFiles(router.tls_cert, router.tls_key, router.tls_client_ca, "metrics port")


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]
