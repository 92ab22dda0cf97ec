"""`pdserve serve`: start (or join) Ray, create the prefill and decode pools, serve the gRPC API.

With no flags it runs everything on this machine: a local Ray, a private redis-server and the
built-in tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

from pdserve.commands import CommandError
from pdserve.commands.config_args import add_config_arguments, config_from_args
from pdserve.config import KVTransferConfig, ServeConfig

ENV_INPUTS = """environment of this process:
  PDSERVE_REDIS_URL   the prefix index Redis, when neither --redis-url nor --redis-url-file
  PDSERVE_KV_SECRET   the workers' shared KV transfer secret, when no --kv-secret-file
  PDSERVE_API_KEYS    comma-separated client API keys (default: no authentication)
  OTEL_*              OpenTelemetry exporters; forwarded to the workers"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ENV_INPUTS
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    groups = add_config_arguments(p, ServeConfig)
    groups[ServeConfig].add_argument(
        "--redis-url-file", type=Path, help="read the Redis URL (password included) from this file"
    )
    groups[KVTransferConfig].add_argument(
        "--kv-secret-file",
        type=Path,
        help="read the shared KV transfer secret from this file (default: env "
        "PDSERVE_KV_SECRET, else a random one)",
    )


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the flags, with the secrets read from their files or environment."""
    config = config_from_args(ServeConfig, args)
    if args.redis_url and args.redis_url_file:
        raise CommandError("--redis-url and --redis-url-file: give one of them")
    if args.redis_url_file:
        config.redis_url = read_secret_file(args.redis_url_file, "--redis-url-file")
    config.redis_url = config.redis_url or os.environ.get("PDSERVE_REDIS_URL") or None
    if args.kv_secret_file:
        config.kv.secret = read_secret_file(args.kv_secret_file, "--kv-secret-file")
    config.kv.secret = config.kv.secret or os.environ.get("PDSERVE_KV_SECRET") or None
    keys = os.environ.get("PDSERVE_API_KEYS", "").split(",")
    config.router.api_keys = [key.strip() for key in keys if key.strip()]
    return config


# Read into the config by serve_config, then taken out of this process's environment before
# Ray starts: a local Ray's processes (raylet, every worker) inherit it, and none needs them.
SECRET_VARIABLES = ("PDSERVE_API_KEYS", "PDSERVE_KV_SECRET", "PDSERVE_REDIS_URL")


def read_secret_file(path: Path, flag: str) -> str:
    """The file's content without surrounding whitespace; CommandError if unreadable or empty."""
    try:
        value = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"{flag}: cannot read {path}: {getattr(e, 'strerror', e)}") from e
    if not value:
        raise CommandError(f"{flag}: {path} is empty")
    return value


def run(args: argparse.Namespace) -> int:
    config = serve_config(args)
    for name in SECRET_VARIABLES:
        os.environ.pop(name, None)
    # Read by Ray at import: no Ray call may start a local cluster of its own. A call made
    # once `ray.shutdown()` ran (at exit) would otherwise start one, with a dashboard.
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    from pdserve.logging_setup import setup_logging

    setup_logging(config.log.level, config.log.format)
    return asyncio.run(_serve(config))


async def _serve(config: ServeConfig) -> int:
    from pdserve.app import ServingApp
    from pdserve.heap import freeze_startup_heap
    from pdserve.startup_checks import StartupError

    app = ServingApp(config, advertise_redis_url=True)
    stop = asyncio.Event()
    try:
        try:
            await app.start()
        except StartupError as e:
            raise CommandError(str(e), exit_code=1) from e
        # The router's event loop runs in this process for its whole life: its startup heap
        # (Ray, gRPC, the tokenizer) is left out of the collector's full passes.
        freeze_startup_heap("router")
        # After start: ray.init installs its own SIGTERM handler, which would kill us uncleanly.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"pdserve serving on port {app.port} "
            f"({config.prefill_workers} prefill, {config.decode_workers} decode workers"
            f"{speculation_note(config)}); Ctrl-C to stop",
            flush=True,
        )
        await stop.wait()
    finally:
        await app.stop()
    return 0


def speculation_note(config: ServeConfig) -> str:
    """ ", decode workers speculate: ngram, k=4" when they do (prefill workers never do)."""
    spec = config.engine.speculative
    if not spec.enabled:
        return ""
    return f", decode workers speculate: {spec.method}, k={spec.num_speculative_tokens}"
