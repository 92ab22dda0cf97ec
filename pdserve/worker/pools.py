"""Creates the worker actors on their Ray pools (custom resources, plus GPUs when configured)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from decode_service.worker import DecodeWorker
from pdserve.config import ServeConfig
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.builtin import default_model_dir
from pdserve.worker.switchable_worker import SwitchableWorker
from pdserve.worker.tp_placement import check_tensor_parallel
from pdserve.worker.worker_spec import WorkerSpec
from prefill_service.worker import PrefillWorker


def create_workers(
    config: ServeConfig,
    redis_url: str | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Starts the prefill and decode actors; returns {worker_id: handle} for each pool.

    Each actor takes one unit of its pool's custom resource, so Ray places prefill actors only on
    nodes that advertise `prefill_pool` and decode actors on `decode_pool` nodes. Actors restart
    after a crash (with a new epoch); calls are not retried by Ray, the router retries requests.
    A worker of TP N (--prefill-tp / --decode-tp) is N rank actors in a STRICT_PACK placement
    group (one node): the handle is rank 0's, which starts the other ranks itself
    (rank_group.py); each rank takes 1/N of the pool unit and its own CPUs and GPUs.
    With --role-switching every actor is a SwitchableWorker started in its pool's role (it
    stays on that pool's node whatever role it serves later); with --hybrid the decode pool's
    actors are SwitchableWorkers serving both roles at once ("hybrid").
    """
    model_dir = Path(config.engine.model or default_model_dir())
    check_tensor_parallel(config, model_dir, ray.nodes())
    pools = (
        ("prefill", PrefillWorker, config.prefill_workers, config.prefill_pool_resource),
        ("decode", DecodeWorker, config.decode_workers, config.decode_pool_resource),
    )
    created: list[dict[str, Any]] = []
    position = 0  # the worker's index over both pools, for CPU pinning
    switchable, hybrid = config.router.role_switching, config.router.hybrid
    for role, cls, count, resource in pools:
        both = hybrid and role == "decode"
        actor_cls = ray.remote(SwitchableWorker if switchable or both else cls)
        role_args = ("hybrid",) if both else (role,) if switchable else ()
        handles = {}
        tp = config.engine_for(role).tp
        for index in range(count):
            worker_id = f"{role}-{index}"
            spec = worker_spec(config, redis_url, position, role)
            rank = rank_options(config, resource, tp)
            placement: dict[str, Any] = {}
            if tp > 1:
                spec.placement_group = _rank_placement_group(worker_id, rank, tp)
                spec.rank_options = rank
                placement["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    spec.placement_group, placement_group_bundle_index=0
                )
            handles[worker_id] = actor_cls.options(
                name=f"pdserve-{worker_id}",
                **rank,
                **placement,
                max_restarts=-1,
                max_task_retries=0,
                max_concurrency=1000,
                runtime_env={"env_vars": forwarded_env()},
            ).remote(worker_id, spec, *role_args)
            position += 1
        created.append(handles)
    return created[0], created[1]


def rank_options(config: ServeConfig, resource: str, tp: int) -> dict[str, Any]:
    """The Ray options of each of a worker's `tp` rank actors (all of a TP-1 worker's): 1/tp of
    its pool's unit, so a pod advertising k units hosts k workers whatever their TP, and
    --cpus-per-worker / --gpus-per-worker each."""
    return {
        "resources": {resource: 1 / tp},
        "num_cpus": config.cpus_per_worker,
        "num_gpus": config.gpus_per_worker,
    }


# The placement groups this process created, by worker id (removed by release_rank_groups).
_RANK_GROUPS: dict[str, PlacementGroup] = {}


def _rank_placement_group(worker_id: str, rank: dict[str, Any], tp: int) -> PlacementGroup:
    bundle = {**rank["resources"], "CPU": rank["num_cpus"], "GPU": rank["num_gpus"]}
    bundle = {name: amount for name, amount in bundle.items() if amount}
    group = placement_group([bundle] * tp, strategy="STRICT_PACK", name=f"pdserve-{worker_id}")
    _RANK_GROUPS[worker_id] = group
    return group


def release_rank_groups() -> None:
    """Removes the placement groups of the TP workers this process started (after their actors
    are killed): their bundles' resources go back to the cluster."""
    while _RANK_GROUPS:
        remove_placement_group(_RANK_GROUPS.popitem()[1])


def worker_spec(config: ServeConfig, redis_url: str | None, position: int, role: str) -> WorkerSpec:
    """What the worker of `role` at `position` (its index over both pools) is started with:
    its pool's engine (torch or sim; see engine_for_role)."""
    affinity = None
    if config.pin_cpus:
        # One core per worker, round robin over this node's cores (benchmarks on one machine:
        # keeps a prefill burst from taking the decode worker's core).
        affinity = {position % (os.cpu_count() or 1)}
    return WorkerSpec(
        engine=engine_for_role(config, role),
        kv=config.kv,
        worker=config.worker,
        log=config.log,
        redis_url=redis_url,
        cpu_affinity=affinity,
        freeze_startup_heap=True,  # a Ray actor: the process is the worker's alone
    )


def engine_for_role(config: ServeConfig, role: str) -> EngineConfig:
    """The engine config of the workers of `role`. Speculative decoding runs in the decode pool
    only: a prefill worker samples one token per request, and a decode worker computes the
    draft model's prompt KV itself, so prefill workers never load a draft model."""
    engine = config.engine_for(role)
    if role == "prefill" and engine.speculative.enabled:
        engine = dataclasses.replace(engine, speculative=SpeculativeConfig())
    return engine


def forwarded_env() -> dict[str, str]:
    """The OpenTelemetry exporter settings of this process, for the workers' environment (the
    standard's channel); not its identity: each worker names itself."""
    own = {"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"}
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_") and k not in own}
