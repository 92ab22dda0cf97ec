"""A served system in a child process, next to one in this process, on the same Ray cluster.

The worker actors are named after their ids, and a driver's named actors live in its own
namespace, so a second system that must be up at the same time as the first (a benchmark
interleaving its runs on both, so drift in the machine's load hits both alike) is served by a
child process joining this process's cluster (which advertises pool resources for both). The
child answers with the router's port, then runs functions on its `ServingApp` (module-level
functions, sent over a pipe) until it is told to stop.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path
from typing import Any

STOP = "stop"


def _host(
    conn: Any, ray_address: str, model_dir: Path, engine: dict, router: dict, workers: tuple
) -> None:
    import ray

    from pdserve.bench.common.local_system import serve_locally

    try:
        ray.init(address=ray_address, log_to_driver=False)
        prefill, decode = workers
        system = serve_locally(
            model_dir, prefill_workers=prefill, decode_workers=decode, engine=engine, router=router
        )
        app = system.__enter__()
    except BaseException as exc:  # reported by the parent, not lost in the child
        conn.send(exc)
        return
    try:
        conn.send(app.port)
        while (command := conn.recv()) != STOP:
            try:
                conn.send(command(app.app))
            except Exception as exc:
                conn.send(exc)
    finally:
        system.__exit__(None, None, None)


class ChildSystem:
    """`with ChildSystem(model_dir, engine, router) as system: system.port, system.call(fn)`:
    `prefill` prefill + `decode` decode workers (0 prefill: colocated) served by a child
    process (see serve_locally) on this process's Ray cluster, which must have as many
    `prefill_pool` and `decode_pool` units free."""

    def __init__(
        self, model_dir: Path, engine: dict, router: dict, prefill: int = 1, decode: int = 1
    ) -> None:
        self._args = (model_dir, engine, router, (prefill, decode))
        self.port = 0

    def __enter__(self) -> ChildSystem:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        import ray

        address = ray.get_runtime_context().gcs_address
        self._process = context.Process(
            target=_host, args=(child, address, *self._args), daemon=True
        )
        self._process.start()
        self.port = self._answer()
        return self

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(the child's ServingApp), run in the child; its result or its exception here."""
        self._conn.send(fn)
        return self._answer()

    def _answer(self) -> Any:
        answer = self._conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def __exit__(self, *exc: object) -> None:
        if self._process.is_alive():
            self._conn.send(STOP)
        self._process.join(timeout=120)
        if self._process.is_alive():
            self._process.kill()
