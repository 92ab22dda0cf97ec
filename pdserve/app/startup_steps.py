"""The small steps ServingApp's start and stop are made of: slow calls off the event loop, ports
bound with start-up's one-line error, stop callables, and settings read from the environment."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

from pdserve.config import RouterConfig, ServeConfig
from pdserve.startup_checks import StartupError, port_in_use
from pdserve.tls_files import CertificateFiles
from router.tls import server_credentials


async def stop_http(http, service, grace_s: float) -> None:
    await http.stop(grace_s)
    service.close()


# Start-up's slow steps run here, off the event loop, so that Ctrl-C (which cancels start-up)
# is seen at once. One thread for the life of the process: Ray's processes get SIGKILL when
# the thread that started them ends (PR_SET_PDEATHSIG, Ray's fate sharing).
_STARTUP_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdserve-startup")


async def off_loop(fn):
    return await asyncio.get_running_loop().run_in_executor(_STARTUP_THREAD, fn)


def bind_port(port: int, flag: str, bind):
    """bind()'s result; a port taken since check_ports_free (or one it could not see) is
    the same one line."""
    try:
        return bind()
    except (OSError, RuntimeError) as e:
        raise StartupError(port_in_use(port, flag)) from e


async def bind_port_async(port: int, flag: str, bind) -> None:
    try:
        await bind()
    except (OSError, RuntimeError) as e:
        raise StartupError(port_in_use(port, flag)) from e


def kill_workers(ray, handles: dict) -> None:
    from pdserve.worker.pools import release_rank_groups

    for handle in handles.values():
        ray.kill(handle, no_restart=True)
    release_rank_groups()  # TP workers' placement groups, once their ranks are gone


def as_async(fn):
    async def call():
        fn()

    return call


def random_secret() -> str:
    import secrets

    return secrets.token_urlsafe(32)


def api_credentials(router: RouterConfig):
    if not router.tls_cert:
        return None
    return server_credentials(router.tls_cert, router.tls_key, router.tls_client_ca)


def metrics_tls(config: ServeConfig) -> CertificateFiles | None:
    """--metrics-tls: the client API's certificate and client CA on the metrics port too."""
    if not config.metrics_tls:
        return None
    router = config.router
    return CertificateFiles(router.tls_cert, router.tls_key, router.tls_client_ca, "metrics port")


def env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]
