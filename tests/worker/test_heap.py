"""The startup heap is frozen out of the collector's full passes (pdserve/heap.py) in the
processes that serve for their whole life: the router's (`pdserve serve`) and every worker
actor's. A process that builds workers in passing (a test) never freezes its own."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap

from decode_service.worker import DecodeWorker
from pdserve.config import ServeConfig
from pdserve.worker import worker_actor
from pdserve.worker.pools import worker_spec
from pdserve.worker.worker_spec import WorkerSpec
from tests.decode_service.workers import spec


def test_a_frozen_startup_heap_leaves_the_oldest_generation_empty() -> None:
    # In a child process: freezing is for good (this test process must not freeze its heap).
    script = textwrap.dedent(
        """
        import gc
        import grpc, router.server, pdserve.prefix_index.lookup  # a router's startup modules
        from pdserve.heap import freeze_startup_heap

        frozen = freeze_startup_heap("test")
        assert frozen == gc.get_freeze_count() > 10_000, frozen
        assert len(gc.get_objects(generation=2)) < 100  # what a full pass would still walk
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_the_pools_workers_freeze_and_a_worker_built_elsewhere_does_not() -> None:
    assert worker_spec(ServeConfig(), None, 0, "decode").freeze_startup_heap
    assert not WorkerSpec().freeze_startup_heap


def test_a_worker_freezes_its_heap_once_started_when_its_spec_says(monkeypatch) -> None:
    frozen: list[str] = []
    monkeypatch.setattr(worker_actor, "freeze_startup_heap", frozen.append)

    async def start(freeze: bool) -> None:
        worker = DecodeWorker("decode-0", dataclasses.replace(spec(), freeze_startup_heap=freeze))
        await worker.ready()
        await worker.ready()  # started once: frozen once
        worker._receiver.stop()
        await asyncio.to_thread(worker._runtime.shutdown)

    asyncio.run(start(freeze=False))
    assert frozen == []
    asyncio.run(start(freeze=True))
    assert frozen == ["decode-0"]
