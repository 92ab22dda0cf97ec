"""WorkerSpec: everything one worker actor is started with, passed as its constructor argument.

Nothing a worker needs travels through Ray's runtime_env (which Ray logs in clear): the KV
secret sits in `kv.secret`, the process settings in `worker` and `log`. Only the OpenTelemetry
variables are forwarded as environment, as that standard expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.config import KVTransferConfig, LogConfig, WorkerConfig
from pdserve.engine_config import EngineConfig


@dataclass
class WorkerSpec:
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    redis_url: str | None = None  # the prefix index; None = the worker publishes nothing
    cpu_affinity: set[int] | None = None  # cores this worker process runs on; None = any
    # Freeze the startup heap once the engine is up (pdserve/heap.py): only where the worker
    # owns its process, as a Ray actor does (the pools set it), never in a test's process.
    freeze_startup_heap: bool = False
    # Tensor parallelism (engine.tp > 1; pdserve/worker/rank_group.py): the STRICT_PACK Ray
    # placement group whose bundle r holds rank r, and the Ray options each rank actor takes
    # from its bundle (num_cpus, num_gpus, resources).
    placement_group: Any = None
    rank_options: dict[str, Any] = field(default_factory=dict)
