"""What the router runs in the background is over when it stops, not merely cancelled: a task
cancelled mid-call keeps that call's Ray reference until it runs again, and Ray ends the
process (status 1, no traceback) when a reference is freed after `ray.shutdown()`."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router import ray_worker
from router.ray_worker import RayWorkerHandle, stop_draining
from router.types import WorkerStats
from router.worker_pool import WorkerPool
from tests.router.flow_cluster import LETTERS, cluster, run, script_after_prompt


class _Endless:
    """An actor's streaming call that never ends (a frozen worker), as the refs Ray returns."""

    def __init__(self) -> None:
        self.released = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            await asyncio.sleep(3600)
        finally:
            self.released.set()


class _Actor:
    """A worker actor with only `stream`, whose call returns the endless refs."""

    def __init__(self) -> None:
        self.refs = _Endless()
        self.stream = SimpleNamespace(remote=lambda *args: self.refs)


def test_stop_draining_ends_every_background_read_of_an_abandoned_stream() -> None:
    async def scenario():
        actor = _Actor()
        stream = RayWorkerHandle(actor).stream("req")
        reading = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        reading.cancel()  # the client went away: the rest is read in the background
        await asyncio.gather(reading, return_exceptions=True)
        await stream.aclose()
        assert len(ray_worker._draining) == 1
        await stop_draining()
        return actor.refs.released.is_set(), set(ray_worker._draining)

    released, left = run(scenario)
    assert released and not left


def test_pool_stop_returns_once_its_pollers_have_ended(tokenizer) -> None:
    async def scenario():
        c = await cluster(tokenizer, script_after_prompt(LETTERS))
        await asyncio.sleep(0.05)  # the pollers are mid-call
        pollers = list(c.pool._pollers)
        await c.pool.stop()
        return pollers

    pollers = run(scenario)
    assert pollers and all(task.done() for task in pollers)


class _HeldHandle:
    """A worker whose calls wait until the test answers them, so a call can end in the very
    step that stops the pool."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[asyncio.Future] = asyncio.Queue()

    async def _held(self, value):
        answer = asyncio.get_running_loop().create_future()
        self.calls.put_nowait(answer)
        await answer
        return value

    async def ready(self):
        return None

    def stats(self):
        return self._held(WorkerStats())

    def heartbeat(self):
        return self._held(0.0)


def test_pool_stop_ends_a_poller_whose_call_answers_as_it_is_cancelled() -> None:
    # Python 3.11's asyncio.wait_for returns the call's result when the call ends in the step
    # that cancels it, and the cancel is lost: the poller went on forever and stop() hung (a
    # CI run's TimeoutError in tests/router/test_request_flow_failover.py).
    async def scenario():
        handle = _HeldHandle()
        pool = WorkerPool({}, {"decode-0": handle}, poll_interval_s=0.01)
        starting = asyncio.ensure_future(pool.start())
        (await handle.calls.get()).set_result(None)  # start()'s own poll
        await starting
        (await handle.calls.get()).set_result(None)  # a poller's call ends ...
        stopping = asyncio.ensure_future(pool.stop())  # ... as the pool stops
        done, _ = await asyncio.wait([stopping], timeout=2.0)
        return bool(done)

    assert run(scenario)
