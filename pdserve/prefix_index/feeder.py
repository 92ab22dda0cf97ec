"""Feeds a worker's KV events to the Redis prefix index from a background thread.

The engine emits events on its own thread mid-step; Redis I/O there would stall decoding, and
a dead Redis must never slow the engine. So events are only queued here; a feeder thread
publishes them in batches and keeps the worker's heartbeat alive (which also resynchronises
the index after an outage, see PrefixIndexPublisher).
"""

from __future__ import annotations

import logging
import queue
import threading

from pdserve.prefix_index.publisher import PrefixIndexPublisher

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.02


class IndexFeeder:
    def __init__(
        self,
        redis_url: str,
        worker_id: str,
        epoch: int,
        model: str,
        block_size: int,
        heartbeat_ttl_s: float,
    ) -> None:
        self.publisher = PrefixIndexPublisher(
            redis_url, worker_id, model, block_size, heartbeat_ttl_s=heartbeat_ttl_s
        )
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._heartbeat_s = heartbeat_ttl_s / 3
        self.publisher.register(epoch)
        self._thread = threading.Thread(target=self._run, name="index-feeder", daemon=True)
        self._thread.start()

    def enqueue(self, events: list) -> None:
        """The engine's kv_event_sink: never blocks."""
        self._events.put(events)

    def _run(self) -> None:
        import time

        next_beat = time.monotonic() + self._heartbeat_s
        while not self._stopped.is_set():
            batch = self._drain(timeout=PUBLISH_INTERVAL_S)
            if batch:
                self.publisher.publish(batch)
            if time.monotonic() >= next_beat:
                self.publisher.heartbeat()
                next_beat = time.monotonic() + self._heartbeat_s

    def _drain(self, timeout: float) -> list:
        batch: list = []
        try:
            batch += self._events.get(timeout=timeout)
            while True:
                batch += self._events.get_nowait()
        except queue.Empty:
            return batch

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self.publisher.unregister()
        self.publisher.close()
