"""Every setting of pdserve, defined once: a dataclass field with its default, help text, CLI flag
and bounds. This module holds the serving settings (KV transfer, router, workers, logs, and
`ServeConfig`, which gathers them with one engine config per pool); the engine's own are in
engine_config.py. `pdserve serve` derives its flags from these fields
(pdserve/commands/config_args.py) and each dataclass checks its values in `__post_init__`, so a
bad setting fails at once with a message naming it, whether it came from the command line or
from code.

Kept free of torch and Ray imports so the router and the CLI can read them cheaply.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pdserve.config_fields import ConfigError, MiB, check_fields, port_setting, setting
from pdserve.config_switchable import check_switchable_workers
from pdserve.disaggregate_modes import parse_disaggregate
from pdserve.engine_config import ENGINE_KINDS, EngineConfig


def default_cache_dir() -> Path:
    """Where the built-in tiny model and other generated files live (never downloaded)."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


@dataclass
class KVTransferConfig:
    """How KV blocks move from a prefill worker to a decode worker."""

    cli_group: ClassVar[str] = "KV transfer"

    transport: str = setting(
        "grpc", "", flag="--kv-transport", choices=("grpc", "collective", "nixl")
    )
    nixl_ucx_tls: str | None = setting(
        None,
        "UCX transports of the nixl transport (UCX_TLS, e.g. tcp, shm, rc,cuda_ipc; default: "
        "UCX picks; docs/kv_transfer.md)",
        flag="--kv-nixl-ucx-tls",
    )
    # Given to the workers inside this config (a constructor argument), never in their
    # environment. `pdserve serve` reads it from --kv-secret-file or env PDSERVE_KV_SECRET,
    # else generates one.
    secret: str | None = setting(None, cli=False)
    bind_host: str | None = setting(
        None,
        "address each decode worker's KV endpoint listens on (default: its advertised address; "
        "0.0.0.0 = every interface)",
        flag="--kv-bind-host",
    )
    advertise_host: str | None = setting(
        None, "host other workers dial (default: the node's IP)", flag="--kv-advertise-host"
    )
    chunk_bytes: int = setting(
        4 * MiB, "target payload of one KV chunk in MiB", flag="--kv-chunk-mb", unit=MiB, minimum=1
    )
    reservation_timeout_s: float = setting(
        30.0, "a decode reservation not committed by then is freed", above=0
    )
    port: int = port_setting(
        0, "port of each decode worker's KV endpoint; 0 = an ephemeral port", flag="--kv-port"
    )
    trust_peer_cache: bool = setting(
        False,
        "let KV received from prefill workers enter the decode prefix cache even without "
        "mTLS (docs/kv_transfer.md)",
        flag="--kv-trust-peer-cache",
    )
    # TLS between workers (kv_transfer/tls.py): all three files, or none.
    tls_cert: str | None = setting(
        None, "PEM certificate of each worker: KV transfer over TLS", flag="--kv-tls-cert"
    )
    tls_key: str | None = setting(None, "PEM private key of --kv-tls-cert", flag="--kv-tls-key")
    tls_ca: str | None = setting(
        None, "PEM CA that signed every worker's --kv-tls-cert", flag="--kv-tls-ca"
    )
    tls_client_auth: bool = setting(
        True,
        "with TLS, KV endpoints refuse peers without a certificate of --kv-tls-ca (mutual TLS)",
        flag="--kv-tls-client-auth",
    )
    tls_server_name: str | None = setting(
        None,
        "name every KV endpoint's certificate carries (default: the address dialed)",
        flag="--kv-tls-server-name",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        files = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}
        if any(files.values()) and not all(files.values()):
            missing = next(name for name, value in files.items() if not value)
            raise ConfigError(
                "KVTransferConfig",
                missing,
                "--kv-tls-cert, --kv-tls-key and --kv-tls-ca go together",
            )

    @property
    def mutual_tls(self) -> bool:
        """Whether every peer of a KV endpoint proves itself with a certificate of `tls_ca`."""
        return bool(self.tls_cert) and self.tls_client_auth

    @property
    def caches_received_kv(self) -> bool:
        """Whether received KV may serve later requests (enter the decode prefix cache): only if
        its sender proved who it is (mutual TLS) or the operator vouches for every peer."""
        return self.trust_peer_cache or self.mutual_tls


# The router's policies (router/policy.py describes each).
ROUTING_POLICIES = ("cost", "round_robin", "least_loaded", "prefix", "approximate", "random")


@dataclass
class RouterConfig:
    """The client-facing gRPC server and its routing policy."""

    cli_group: ClassVar[str] = "router"

    host: str = setting("0.0.0.0", "address of the gRPC API")
    port: int = port_setting(50051, "port of the gRPC API; 0 = any free port")
    # The OpenAI-compatible HTTP API beside gRPC (router/http/), same requests and API keys.
    http_host: str = setting("0.0.0.0", "address of the OpenAI-compatible HTTP API")
    http_port: int = port_setting(8000, "port of the OpenAI-compatible HTTP API; 0 = any free port")
    stream_one_token_per_event: bool = setting(
        False,
        "HTTP streams send every token as its own server-sent event, though a decode worker "
        "sent several at once (what clients timing inter-token latency per event expect)",
    )
    # /v1/responses keeps each stored response in the prefix index's Redis this long, up to
    # this size (router/http/response_store.py).
    response_ttl_s: int = setting(
        3600,
        "a stored /v1/responses response (what previous_response_id continues) expires after "
        "this many seconds",
        flag="--response-ttl",
        minimum=1,
    )
    response_max_bytes: int = setting(
        4 << 20,
        "largest stored /v1/responses conversation in bytes; a request whose conversation "
        "would be stored larger is refused (400)",
        minimum=1,
    )
    policy: str = setting("cost", "", choices=ROUTING_POLICIES)
    # Router replicas must not pick alike: unset, each draws its own (router/policy.py).
    policy_seed: int | None = setting(
        None,
        "seed of the policy's random picks and rotations, to repeat a run (default: system "
        "entropy, so that router replicas do not send to the same workers in step)",
    )
    # The cost policy's ties widen with replicas, which see only their own routes between two
    # polls (router/policy.py); one router sees all of them.
    router_replicas: int = setting(
        1,
        "routers sending to these workers side by side (behind one load balancer); with more "
        "than one, the cost policy takes options within 0.05 of the best as ties (0.01 for one "
        "router), so that replicas, which cannot see each other's routes, do not pick alike",
        minimum=1,
    )
    disaggregate: str = setting(
        "auto",
        "prefill on a prefill worker: auto (by cost), always, never, threshold:N (when more "
        "than N tokens are uncached) or conditional:LEN:QUEUE (when more than LEN are uncached "
        "and fewer than QUEUE prefills wait)",
    )
    ttft_slo_ms: float = setting(1000.0, "time-to-first-token objective", above=0)
    tpot_slo_ms: float = setting(100.0, "time-per-output-token objective", above=0)
    max_pending_requests: int = setting(
        256, "admission control: beyond this, RESOURCE_EXHAUSTED", minimum=1
    )
    max_retries: int = setting(
        2, "retries of a failed prefill/transfer/decode on other workers", minimum=0
    )
    # Client authentication; empty = none. `pdserve serve` reads env PDSERVE_API_KEYS.
    api_keys: list[str] = setting(cli=False, default_factory=list)
    max_queued_prefill_tokens: int = setting(
        65536, "a worker whose prompt queue passes this many tokens takes no more", minimum=1
    )
    tpot_weight: float = setting(
        1.0, "weight of TPOT against TTFT in the routing objective", minimum=0
    )
    progress_timeout_s: float = setting(5.0, "fail over from a worker silent this long", minimum=0)
    # Answered by a worker's event loop, not its engine (router/worker_pool.py): far shorter
    # than a long engine step may rightly last.
    heartbeat_timeout_s: float = setting(
        2.0, "fail over from a worker process that answers no heartbeat this long", above=0
    )
    # router/peer_pull.py: a decode worker prefilling a request pulls the prefix another decode
    # worker caches when the cost model says the transfer beats recomputing it.
    peer_pull: bool = setting(
        False,
        "a decode worker that prefills a request pulls its prefix from the decode worker "
        "caching more of it, when that beats recomputing",
    )
    # pdserve/prefix_index/mirror.py: no Redis round trip per routing decision.
    index_mirror: bool = setting(
        True, "keep a copy of the prefix index in the router, fed by the workers' KV events"
    )
    # The client API edge: request size, TLS, shutdown (router/server.py, router/tls.py).
    max_prompt_bytes: int | None = setting(
        None,
        "largest text prompt in UTF-8 bytes (default: 32 per token of the context); the gRPC "
        "receive limit and the HTTP body cap follow",
        minimum=1,
    )
    tls_cert: str | None = setting(None, "PEM certificate chain: the gRPC API speaks TLS")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = setting(
        None, "PEM CA of client certificates: mutual TLS, clients without one are refused"
    )
    health_port: int | None = port_setting(
        None, "a plaintext port serving only gRPC health, for probes that cannot speak TLS"
    )
    shutdown_grace_s: float = setting(
        30.0,
        "on SIGTERM, running requests get this long to finish (new ones are refused)",
        minimum=0,
    )
    plan_interval_s: float = setting(
        0.0,
        "every this many seconds, plan the prefill/decode split for the last window's traffic "
        "from measured costs (docs/planner.md); 0 = off",
        flag="--plan-interval",
        minimum=0,
    )
    # Acting on the online plan (router/role_switch.py, docs/design.md "Role switching").
    role_switching: bool = setting(
        False,
        "move workers between prefill and decode, without a restart, towards the online "
        "planner's split (needs --plan-interval)",
    )
    # Hybrid workers (router/worker_pool.py, docs/design.md "Hybrid workers").
    hybrid: bool = setting(
        False,
        "every decode worker also prefills for the others: with --disaggregate auto the router "
        "chooses per request between a local prefill and one on another worker, and no GPU "
        "only prefills (the layout where a split does not pay)",
    )
    role_switch_dwell_s: float = setting(
        60.0, "role switching: at least this many seconds between two switches", minimum=0
    )
    role_switch_margin: float = setting(
        0.1,
        "role switching: switch only when the planned split's goodput beats the current "
        "split's by this fraction",
        minimum=0,
    )
    role_switch_drain_s: float = setting(
        30.0,
        "role switching: how long a worker's requests of its old role may take to finish "
        "before it serves the new one anyway (they finish on the same engine)",
        minimum=0,
    )

    def __post_init__(self) -> None:
        check_fields(self)
        try:
            parse_disaggregate(self.disaggregate)
        except ValueError as e:
            raise ConfigError("RouterConfig", "disaggregate", str(e)) from None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("RouterConfig", "tls_key", "--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("RouterConfig", "tls_client_ca", "needs --tls-cert and --tls-key")
        if self.role_switching and not self.plan_interval_s:
            raise ConfigError("RouterConfig", "role_switching", "needs --plan-interval")


@dataclass
class WorkerConfig:
    """Settings of each worker process, given to the actor as part of its constructor argument."""

    cli_group: ClassVar[str] = "workers"

    metrics_port: int | None = port_setting(
        None,
        "each worker's Prometheus endpoint; 0 = an ephemeral port (default: off)",
        flag="--worker-metrics-port",
    )
    prefix_heartbeat_ttl_s: float = setting(
        10.0, "a worker silent this long drops out of the prefix index", above=0
    )
    fault_injection: bool = setting(
        False, "let tests and drills arm PrefillWorker.inject_fault", flag="--fault-injection"
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class LogConfig:
    """Log lines of the router and of every worker."""

    cli_group: ClassVar[str] = "logging"

    format: str = setting("text", "", flag="--log-format", choices=("text", "json"))
    # WARNING: start-up's progress lines say what happens; -v / --log-level INFO adds the
    # components' own lines (pdserve's and Ray's).
    level: str = setting(
        "WARNING",
        "",
        flag="--log-level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    )

    def __post_init__(self) -> None:
        self.level = self.level.upper()
        check_fields(self)


@dataclass
class ServeConfig:
    """`pdserve serve`: the whole system."""

    cli_group: ClassVar[str] = "deployment"

    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    prefill_workers: int = setting(
        1,
        "prefill worker actors; 0 = colocated: each prompt is prefilled on its decode worker",
        minimum=0,
    )
    decode_workers: int = setting(1, "decode worker actors", minimum=1)
    ray_address: str | None = setting(
        None, "join this Ray cluster ('auto' = the running one); default: start a local Ray"
    )
    ray_resources_wait_s: float = setting(
        60.0,
        "with --ray-address, how long to wait for nodes with the pools' resources to join "
        "before refusing to start",
        minimum=0,
    )
    prefill_pool_resource: str = setting("prefill_pool", "Ray custom resource of the prefill pool")
    decode_pool_resource: str = setting("decode_pool", "Ray custom resource of the decode pool")
    gpus_per_worker: float = setting(0.0, "num_gpus of each worker actor", minimum=0)
    cpus_per_worker: float = setting(0.0, "num_cpus of each worker actor", minimum=0)
    pin_cpus: bool = setting(
        False, "pin each worker process to its own core (single-node benchmarks)"
    )
    # A URL with a password shows in `ps` when given as a flag: prefer the file or env input.
    redis_url: str | None = setting(
        None,
        "prefix index Redis (redis:// or rediss://); default: env PDSERVE_REDIS_URL, "
        "else a private redis-server. Visible in ps: prefer --redis-url-file",
    )
    metrics_port: int | None = port_setting(
        None, "the router's Prometheus endpoint; 0 = any free port (default: off)"
    )
    # Where the router's Prometheus endpoint listens: 127.0.0.1 keeps it to this host
    # (README "Securing the router").
    metrics_host: str = setting("0.0.0.0", "address of the router's Prometheus endpoint")
    metrics_tls: bool = setting(
        False,
        "serve the router's Prometheus endpoint over TLS with --tls-cert/--tls-key; with "
        "--tls-client-ca, scrapers must present a client certificate it signed",
    )
    prefill_engine: str | None = setting(
        None, "engine of the prefill workers (default: --engine)", choices=ENGINE_KINDS
    )
    decode_engine: str | None = setting(
        None, "engine of the decode workers (default: --engine)", choices=ENGINE_KINDS
    )
    # A worker of TP N is N rank actors on one node (docs/design.md, "Engine: tensor
    # parallelism"): each takes --gpus-per-worker / --cpus-per-worker of its own.
    prefill_tp: int = setting(1, "tensor-parallel ranks of each prefill worker", minimum=1)
    decode_tp: int = setting(1, "tensor-parallel ranks of each decode worker", minimum=1)
    # docs/design.md, "Engine: mixture of experts": without it a TP worker's MoE layers run
    # each rank's experts on every token and all-reduce.
    expert_parallel: bool = setting(
        False,
        "MoE models on TP workers (--prefill-tp/--decode-tp > 1): each rank routes 1/N of a "
        "step's tokens and sends them to their experts' ranks with all_to_all",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.metrics_tls and not self.router.tls_cert:
            raise ConfigError("ServeConfig", "metrics_tls", "needs --tls-cert and --tls-key")
        if self.expert_parallel and self.prefill_tp == self.decode_tp == 1:
            raise ConfigError(
                "ServeConfig",
                "expert_parallel",
                "needs --prefill-tp or --decode-tp above 1 (both are 1): it spreads a "
                "worker's experts over its tensor-parallel ranks",
            )
        for role in ("prefill", "decode"):
            if self.engine_for(role).kind == "sim" and self.kv.transport != "grpc":
                name = f"{role}_engine" if getattr(self, f"{role}_engine") else "engine"
                raise ConfigError("ServeConfig", name, "simulated workers need --kv-transport grpc")
            if self.engine.kv_disk_gb and getattr(self, f"{role}_tp") > 1:
                # Every rank copies its heads to and from host memory (tp_executor.py); each
                # rank's files, and a read failing on one rank only, are not built yet.
                raise ConfigError(
                    "ServeConfig", f"{role}_tp", "--kv-disk-gb is not supported yet under TP"
                )
            if self.engine_for(role).kind == "sim" and getattr(self, f"{role}_tp") > 1:
                raise ConfigError(
                    "ServeConfig",
                    f"{role}_tp",
                    "simulated workers model tensor parallelism in --sim-profile "
                    "(analytical:GPU:tpN), not with rank actors",
                )

        check_switchable_workers(self)

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of the workers of `role` ("prefill" or "decode")."""
        kind = getattr(self, f"{role}_engine") or self.engine.kind
        tp = getattr(self, f"{role}_tp")
        expert_parallel = self.expert_parallel and tp > 1
        engine = self.engine
        if (kind, tp, expert_parallel) == (engine.kind, engine.tp, engine.expert_parallel):
            return engine
        return dataclasses.replace(engine, kind=kind, tp=tp, expert_parallel=expert_parallel)
