"""The prefix index's series (router): `REDIS_UP` and the router's copy of the index
(`INDEX_MIRROR_UP`, `INDEX_MIRROR_EVENTS`, `INDEX_MIRROR_READS{scope}`)."""

from prometheus_client import Counter, Gauge

REDIS_UP = Gauge(
    "pdserve_redis_up",
    "1 if the prefix index's Redis answered its last call (the router pings it every second).",
)
INDEX_MIRROR_UP = Gauge(
    "pdserve_index_mirror_up",
    "1 while the router's copy of the prefix index is built and follows the event stream.",
)
INDEX_MIRROR_EVENTS = Counter(
    "pdserve_index_mirror_events",
    "Entries of the prefix index's event stream applied to the router's copy.",
)
INDEX_MIRROR_READS = Counter(
    "pdserve_index_mirror_reads",
    "State the router's copy of the prefix index read from Redis: whole (build: at start, after "
    "an outage) or one worker's blocks (worker: a reset, a restart, a gap in its events).",
    ["scope"],
)
