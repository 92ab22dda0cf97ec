"""The Ray that `pdserve serve` runs on: a private one of its own, or the cluster --ray-address
names, checked for the pools' resources.

A private Ray is always a new one: `ray.init(address=None)` would join whatever cluster a
`ray start` left on the machine (or the one RAY_ADDRESS names), so it is started with
address="local". Its processes (GCS, raylet, agents, workers) run in their own session: the
terminal's Ctrl-C reaches only `pdserve serve`, which stops them itself.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.config import ServeConfig
from pdserve.startup_checks import StartupError

RESOURCES_POLL_S = 1.0


def start_private_ray(config: ServeConfig, verbose: bool) -> None:
    """A new local Ray advertising both pools, sized to the requested workers. Quiet unless
    `verbose`: Ray's own INFO and WARNING lines (token authentication, "Started a local Ray
    instance") and the workers' output are for --log-level INFO; a worker's failure reaches
    the start-up lines, the clients and /ready by itself (router/worker_pool.py)."""
    import ray

    os.environ.pop("RAY_ADDRESS", None)  # ray.init would join that cluster instead
    with _own_session():
        ray.init(
            address="local",
            resources=pool_resources(config),
            include_dashboard=False,
            log_to_driver=verbose,
            logging_level=logging.INFO if verbose else logging.ERROR,
        )


def join_ray(config: ServeConfig) -> None:
    """Connects to --ray-address; StartupError when it cannot, or when the cluster still lacks
    the resources the pools need after --ray-resources-wait-s."""
    import ray

    try:
        ray.init(address=config.ray_address, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise StartupError(f"--ray-address {config.ray_address}: {_first_line(e)}") from e
    # Worker nodes may join after the router (pods starting together): they get a while.
    deadline = time.monotonic() + config.ray_resources_wait_s
    while True:
        try:
            check_pool_resources(config, ray.cluster_resources())
            return
        except StartupError:
            if time.monotonic() >= deadline:
                ray.shutdown()
                raise
        time.sleep(RESOURCES_POLL_S)


async def stop_ray() -> None:
    """Leaves Ray (stops a private one) once nothing of ours still holds a Ray reference: an
    ObjectRef freed after `ray.shutdown()` makes Ray end the process at once, exit status 1
    and no traceback (a SIGTERM with streams in flight exited so: their background reads,
    and the garbage collector's unreachable cycles, freed theirs after the shutdown)."""
    import gc

    import ray

    from router.ray_worker import stop_draining

    await stop_draining()
    gc.collect()
    ray.shutdown()


def pool_resources(config: ServeConfig) -> dict[str, float]:
    """The custom resources a private Ray advertises: one unit per worker of each pool."""
    return {
        config.prefill_pool_resource: max(config.prefill_workers, 1),
        config.decode_pool_resource: max(config.decode_workers, 1),
    }


def needed_resources(config: ServeConfig) -> dict[str, float]:
    """What the worker actors take from the cluster in all (pools.create_workers)."""
    workers = config.prefill_workers + config.decode_workers
    needed = {
        config.prefill_pool_resource: config.prefill_workers,
        config.decode_pool_resource: config.decode_workers,
        "CPU": config.cpus_per_worker * workers,
        "GPU": config.gpus_per_worker * workers,
    }
    return {name: amount for name, amount in needed.items() if amount > 0}


def check_pool_resources(config: ServeConfig, available: dict[str, float]) -> None:
    """StartupError naming what is needed and what the cluster has, when it has too little."""
    needed = needed_resources(config)
    short = {name for name, amount in needed.items() if available.get(name, 0) < amount}
    if short:
        wants = ", ".join(f"{name} {_amount(amount)}" for name, amount in needed.items())
        has = ", ".join(f"{name} {_amount(available.get(name, 0))}" for name in needed)
        raise StartupError(
            f"--ray-address {config.ray_address}: the cluster lacks the pools' resources: "
            f"needs {wants}; has {has} (see --prefill-pool-resource, --decode-pool-resource)"
        )


@contextmanager
def _own_session() -> Iterator[None]:
    """Every process Ray starts meanwhile begins its own session (setsid), out of the
    terminal's process group. Ray 2.60 has no option for it: its launcher, ConsolePopen, is a
    plain subprocess.Popen on Linux, so a subclass that asks for a new session stands in."""
    from ray._private import services

    original = services.ConsolePopen

    class SessionPopen(original):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    assert issubclass(original, subprocess.Popen)
    services.ConsolePopen = SessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = original


def _amount(value: float) -> str:
    return f"{value:g}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
