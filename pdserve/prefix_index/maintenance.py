"""IndexMaintenance: the router's background upkeep of the prefix index, on its own thread.

Every `interval_s` it pings Redis, so `pdserve_redis_up` follows the server within seconds even
when no request is routed (otherwise the gauge only moves with traffic), and, while Redis
answers, runs one bounded garbage-collection round (IndexSweeper). Both go through the index's
RedisLink: a dead Redis costs at most one short socket timeout per backoff period, never an
exception.
"""

from __future__ import annotations

import logging
import threading

from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.sweeper import IndexSweeper

log = logging.getLogger(__name__)


class IndexMaintenance:
    """`start()` the thread, `stop()` it (idempotent). Use one per router process."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        interval_s: float = 1.0,
        sweeper: IndexSweeper | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.index = index
        self.interval_s = interval_s
        self.sweeper = sweeper or IndexSweeper(index)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-maintenance", daemon=True)

    def start(self) -> IndexMaintenance:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                if self.index.link.ping():
                    swept = self.sweeper.sweep()
                    if swept.dead_entries or swept.stale_entries:
                        log.debug("prefix index garbage collection: %s", swept)
            except Exception:  # the upkeep must outlive any surprise; routing does not need it
                log.exception("prefix index maintenance round failed")
            self._stopped.wait(self.interval_s)
