"""`pdserve serve`: start (or join) Ray, create the prefill and decode pools, serve the gRPC API.

With no flags it runs everything on this machine: a local Ray, a private redis-server and the
built-in tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from pdserve.commands import CommandError
from pdserve.commands.config_args import add_config_arguments, config_from_args
from pdserve.config import KVTransferConfig, ServeConfig

ENV_INPUTS = """environment of this process:
  PDSERVE_REDIS_URL   the prefix index Redis, when neither --redis-url nor --redis-url-file
  PDSERVE_KV_SECRET   the workers' shared KV transfer secret, when no --kv-secret-file
  PDSERVE_API_KEYS    comma-separated client API keys (default: no authentication)
  OTEL_*              OpenTelemetry exporters; forwarded to the workers
  PDSERVE_HIDE_CPU_FEATURES  CPU flags the start-up dtype check treats as missing"""

log = logging.getLogger(__name__)

STOP_WAIT_S = 3.0  # Ctrl-C during start-up: what was started gets this long to stop cleanly


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
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show pdserve's and Ray's INFO lines (-vv: DEBUG); as --log-level INFO",
    )


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the flags, with the secrets read from their files or environment."""
    config = config_from_args(ServeConfig, args)
    if args.verbose:
        config.log.level = "DEBUG" if args.verbose > 1 or config.log.level == "DEBUG" else "INFO"
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
    # Ray's lines forwarded from the workers: no colour codes, no "[repeated 3x]" hints (read
    # when Ray is imported and when it prints).
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    for name in SECRET_VARIABLES:
        os.environ.pop(name, None)
    # Read by Ray at import: no Ray call may start a local cluster of its own. A call made
    # once `ray.shutdown()` ran (at exit) would otherwise start one, with a dashboard.
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    from pdserve.logging_setup import setup_logging

    setup_logging(config.log.level, config.log.format)
    try:
        return asyncio.run(_serve(config))
    except KeyboardInterrupt:  # Ctrl-C before _serve handles it: nothing started yet
        print("pdserve serve: interrupted", file=sys.stderr, flush=True)
        return 130


async def _serve(config: ServeConfig) -> int:
    from pdserve.app import ServingApp
    from pdserve.heap import freeze_startup_heap
    from pdserve.process_tree import kill_descendants
    from pdserve.startup_checks import StartupError
    from pdserve.startup_progress import StartupProgress

    progress = StartupProgress(config.prefill_workers + config.decode_workers)
    verbose = config.log.level in ("DEBUG", "INFO")
    app = ServingApp(config, advertise_redis_url=True, progress=progress, verbose_ray=verbose)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Ctrl-C or SIGTERM: during start-up it cancels the start (its slow steps run off the
    # event loop, so the loop sees the signal at once), later it ends the wait below.
    starting = asyncio.ensure_future(app.start())

    def on_signal() -> None:
        if starting.done():
            stop.set()
        else:
            progress.mute()
            starting.cancel()

    def handle_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)

    handle_signals()
    app.after_ray_started = handle_signals  # ray.init replaced them
    try:
        try:
            await starting
        except StartupError as e:
            raise CommandError(str(e), exit_code=1) from e
        except asyncio.CancelledError:
            await _stop_interrupted(app, verbose)
        progress.close()
        # The router's event loop runs in this process for its whole life: its startup heap
        # (Ray, gRPC, the tokenizer) is left out of the collector's full passes.
        freeze_startup_heap("router")
        print(f"pdserve {ready_line(app)}{speculation_note(config)}); Ctrl-C to stop", flush=True)
        await stop.wait()
    finally:
        progress.close()
        await app.stop()
        kill_descendants()  # what a failed stop left (Ray's processes, a worker), if anything
    print("pdserve serve: stopped", file=sys.stderr, flush=True)
    return 0


async def _stop_interrupted(app, verbose: bool) -> NoReturn:
    """Ctrl-C during start-up: stops what was started, kills whatever of it remains (a Ray
    still starting in its thread), says so in one line and exits at once (130, as a shell
    reports SIGINT). Errors of the half-started parts' shutdown are not news then."""
    app.progress.close()
    if not verbose:
        logging.disable(logging.ERROR)
    # A stop step may block the event loop itself (`ray.shutdown()` racing a `ray.init` still
    # running in its thread; a CI run hung past 30 s so), which `wait_for` cannot time out:
    # a timer thread ends the process regardless.
    deadline = threading.Timer(STOP_WAIT_S + 1.0, _exit_interrupted, args=(app,))
    deadline.daemon = True
    deadline.start()
    try:
        await asyncio.wait_for(app.stop(), STOP_WAIT_S)
    except Exception:
        log.debug("stopping a half-started server", exc_info=True)  # killed next anyway
    _exit_interrupted(app)


def _exit_interrupted(app) -> NoReturn:
    from pdserve.process_tree import kill_descendants

    # No wait for the killed: a start-up thread may still be waiting on a process Ray is
    # spawning (its GCS), and then psutil's wait on that same child never returned (a CI run
    # hung past 30 s here; faulthandler's stacks showed it). SIGKILL needs no confirmation
    # from a process about to exit.
    kill_descendants(wait=False)
    seconds = app.progress.elapsed_s
    print(
        f"pdserve serve: interrupted during start-up after {seconds:.1f} s; stopped",
        file=sys.stderr,
        flush=True,
    )
    os._exit(130)  # Ray's exit hooks would wait for a start-up thread that is still running


def ready_line(app) -> str:
    """ "ready in 21.3 s: gRPC on port 50051, HTTP on port 8000 (1/1 prefill, 1/1 decode
    workers" (the caller closes the parenthesis, after its notes)."""
    config = app.config
    metrics = f", metrics on port {app.metrics_port}" if app.metrics_port is not None else ""
    healthy = {role: len(app.pool.of_role(role)) for role in ("prefill", "decode")}
    return (
        f"ready in {app.progress.elapsed_s:.1f} s: gRPC on port {app.port}, HTTP on port "
        f"{app.http_port}{metrics} ({healthy['prefill']}/{config.prefill_workers} prefill, "
        f"{healthy['decode']}/{config.decode_workers} decode workers"
    )


def speculation_note(config: ServeConfig) -> str:
    """ ", decode workers speculate: ngram, k=4" when they do (prefill workers never do)."""
    spec = config.engine.speculative
    if not spec.enabled:
        return ""
    return f", decode workers speculate: {spec.method}, k={spec.num_speculative_tokens}"
