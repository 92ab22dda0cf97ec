"""Every setting of pdserve as a plain dataclass; CLI flags map one to one onto these fields.

Kept free of torch and Ray imports so the router and the CLI can read them cheaply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20


def default_cache_dir() -> Path:
    """Where the built-in tiny model and other generated files live (never downloaded)."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


@dataclass
class EngineConfig:
    """One engine (any role): which model, how big the paged KV cache is, how a step is batched."""

    model: str | None = None  # Hugging Face model directory; None = the built-in tiny model
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # exact KV pool size in blocks; overrides kv_cache_bytes
    kv_cache_bytes: int = 256 * MiB  # KV pool size in bytes when num_kv_blocks is None
    max_num_seqs: int = 64  # most sequences in one step
    max_num_batched_tokens: int = 1024  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default


@dataclass
class KVTransferConfig:
    """How KV blocks move from a prefill worker to a decode worker."""

    transport: str = "grpc"  # grpc | collective
    secret: str | None = None  # shared secret; default: env PDSERVE_KV_SECRET, else generated
    bind_host: str = "0.0.0.0"  # where the decode worker's KV server listens
    advertise_host: str | None = None  # host other workers dial; default: the node's Ray IP
    chunk_bytes: int = 4 * MiB  # target payload of one chunk
    reservation_timeout_s: float = 30.0  # a reservation not committed by then is freed
    port: int = 0  # port of the decode worker's KV endpoint; 0 = an ephemeral port


@dataclass
class RouterConfig:
    """The client-facing gRPC server and its routing policy."""

    host: str = "0.0.0.0"
    port: int = 50051
    policy: str = "cost"  # cost | round_robin | least_loaded
    disaggregate: str = "auto"  # auto | always | never
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    max_pending_requests: int = 256  # admission control: beyond this, RESOURCE_EXHAUSTED
    max_retries: int = 2  # retries of a failed prefill/transfer/decode on other workers
    api_keys: list[str] = field(default_factory=list)  # empty = no client authentication
    # Admission control per worker: a prompt queue past this many tokens takes no more requests.
    max_queued_prefill_tokens: int = 65536
    tpot_weight: float = 1.0  # weight of TPOT against TTFT in the routing objective
    prefix_heartbeat_ttl_s: float = 10.0  # a worker silent this long drops out of the prefix index


@dataclass
class ServeConfig:
    """`pdserve serve`: the whole system."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill_workers: int = 1
    decode_workers: int = 1
    ray_address: str | None = None  # None = start a local Ray; "auto" = join the running one
    prefill_pool_resource: str = "prefill_pool"  # Ray custom resource of the prefill pool
    decode_pool_resource: str = "decode_pool"  # Ray custom resource of the decode pool
    gpus_per_worker: float = 0.0  # num_gpus of each worker actor (0 on CPU pools)
    cpus_per_worker: float = 0.0  # num_cpus of each worker actor
    pin_cpus: bool = False  # pin each worker process to its own core (single-node benchmarks)
    redis_url: str | None = None  # None = start a private redis-server
    metrics_port: int | None = None  # Prometheus endpoint of the router; None = off
    log_format: str = "text"  # text | json
    log_level: str = "INFO"
