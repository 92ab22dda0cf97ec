"""PrefixIndexPublisher: a worker's side of the prefix index (Redis), fed by its KV events.

A worker creates one, calls `register()` once, `publish(events)` for every batch of KV events
(`pdserve.core.kv_events.KVEvent` or anything with `kind` and `block_hashes`), and
`heartbeat()` every `heartbeat_ttl_s / 3` seconds. None of these raises on a Redis outage; they
return False instead. The publisher remembers the set of hashes the worker holds (from the
events themselves) and which of them are in host memory or on disk (a "stored" event's `tier`:
a block that moves between tiers is an update, not a removal), so after an outage, a Redis restart or a missed heartbeat it rewrites that
whole set in one transaction (`resync`) without asking the engine. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from pdserve.prefix_index.redis_link import RedisLink
from pdserve.prefix_index.schema import (
    DROP_WORKER_LUA,
    EVENTS_MAXLEN,
    HEARTBEAT_LUA,
    LOWER_TIERS,
    IndexKeys,
    epoch_str,
)

log = logging.getLogger(__name__)


class KVEventLike(Protocol):
    kind: str  # "stored" | "removed"
    block_hashes: list[int]
    tier: str  # "device" | "host" | "disk"


class PrefixIndexPublisher:
    def __init__(
        self,
        redis_url: str,
        worker_id: str,
        model: str,
        block_size: int,
        *,
        heartbeat_ttl_s: float = 10.0,
        namespace: str = "pdserve",
        socket_timeout_s: float = 0.3,
    ) -> None:
        if heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {heartbeat_ttl_s}")
        self.worker_id = worker_id
        self.block_size = block_size
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.keys = IndexKeys(model, namespace)
        self.link = RedisLink(redis_url, name="publisher", socket_timeout_s=socket_timeout_s)
        self.link.on_reconnect.append(self._lost_sync)
        self._drop = self.link.client.register_script(DROP_WORKER_LUA)
        self._beat = self.link.client.register_script(HEARTBEAT_LUA)
        self._lock = threading.RLock()
        self._held: set[int] = set()
        self._tier: dict[int, str] = {}  # of _held, the blocks below the device: their tier
        self._epoch: str | None = None
        self._published = 0  # updates in the event stream since the last reset (schema.py)
        self.needs_resync = True  # nothing is in Redis until the first successful resync
        self.fenced = False  # a newer epoch of this worker exists: stop writing

    @property
    def available(self) -> bool:
        return self.link.available

    @property
    def epoch(self) -> int | None:
        return None if self._epoch is None else int(self._epoch)

    @property
    def held_hashes(self) -> frozenset[int]:
        """Hashes of the blocks this worker holds, as its events describe them."""
        with self._lock:
            return frozenset(self._held)

    def register(self, epoch: int | None = None) -> bool:
        """Starts a new epoch (default: now in ns). Entries of older epochs stop counting at once
        and are deleted. Returns True when Redis has the registration now (else it is retried
        by `heartbeat()`)."""
        with self._lock:
            self._epoch = epoch_str(time.time_ns() if epoch is None else epoch)
            self.fenced = False
            self.needs_resync = True
            return self.resync()

    def publish(self, events: Iterable[KVEventLike]) -> bool:
        """Applies a batch of KV events in one round trip. True when Redis has them."""
        with self._lock:
            stored: list[int] = []
            removed: list[int] = []
            was: dict[int, str] = {}  # each touched hash: its tier before the batch
            for event in events:
                for h in event.block_hashes:
                    was.setdefault(h, self._tier.get(h, "device"))
                if event.kind == "stored":
                    stored += event.block_hashes
                    self._held.update(event.block_hashes)
                    for h in event.block_hashes:
                        if event.tier == "device":
                            self._tier.pop(h, None)
                        else:
                            self._tier[h] = event.tier
                    removed_now = set(event.block_hashes)
                    removed = [h for h in removed if h not in removed_now]
                elif event.kind == "removed":
                    removed += event.block_hashes
                    self._held.difference_update(event.block_hashes)
                    for h in event.block_hashes:
                        self._tier.pop(h, None)
                    removed_now = set(event.block_hashes)
                    stored = [h for h in stored if h not in removed_now]
                else:
                    raise ValueError(f"unknown KV event kind {event.kind!r}")
            if self._epoch is None or self.fenced:
                return False
            if self.needs_resync:
                return self.resync()
            if not stored and not removed:
                return True
            moves = [(h, b, self._tier.get(h, "device")) for h, b in was.items()]
            moves = [m for m in moves if m[1] != m[2]]
            ok = self.link.call(lambda client: self._apply(client, stored, removed, moves), False)
            if not ok:
                self.needs_resync = True  # these events are lost: rewrite everything later
            return ok

    def heartbeat(self) -> bool:
        """Renews liveness; re-registers and resynchronises when Redis lost our entries.
        True when Redis holds an up-to-date view of this worker afterwards."""
        with self._lock:
            if self._epoch is None or self.fenced:
                return False
            if self.needs_resync:
                return self.resync()
            result = self.link.call(lambda client: self._beat_once(client), None)
            if self._failed(result):
                return False
            if result == 0 or self.needs_resync:  # our heartbeat key was gone: entries may be too
                self.needs_resync = True
                return self.resync()
            return True

    def resync(self, block_hashes: Iterable[int] | None = None) -> bool:
        """Replaces everything Redis has for this worker with `block_hashes` (default: the set
        the events describe) and renews the heartbeat, atomically. True on success."""
        with self._lock:
            if block_hashes is not None:
                self._held = set(block_hashes)
                self._tier = {h: t for h, t in self._tier.items() if h in self._held}
            if self._epoch is None or self.fenced:
                return False
            hashes = sorted(self._held)
            result = self.link.call(lambda client: self._rewrite(client, hashes), None)
            if self._failed(result):
                return False
            self.needs_resync = False
            return True

    def unregister(self) -> None:
        """Clean shutdown: this worker's entries and heartbeat disappear now, not after the TTL."""
        with self._lock:
            if self._epoch is None or self.fenced:
                return

            def drop(client) -> None:
                pipe = client.pipeline(transaction=True)
                self._drop(
                    keys=[self.keys.worker_blocks(self.worker_id)],
                    args=[self.keys.block_prefix, self.worker_id],
                    client=pipe,
                )
                pipe.delete(self.keys.heartbeat(self.worker_id))
                for tier in LOWER_TIERS:
                    pipe.delete(self.keys.worker_tier_blocks(self.worker_id, tier))
                self._event(pipe, op="drop")
                pipe.execute()

            self.link.call(drop, None)
            self._epoch = None

    def close(self) -> None:
        self.link.close()

    def _apply(
        self,
        client,
        stored: list[int],
        removed: list[int],
        moves: list[tuple[int, str, str]],
    ) -> bool:
        """`moves`: (hash, tier before, tier after) of the blocks that changed tiers (a block
        not held counts as "device": it is in no tier's list)."""
        pipe = client.pipeline(transaction=False)
        for tier in LOWER_TIERS:
            leaving = [h for h, before, after in moves if before == tier]
            entering = [h for h, before, after in moves if after == tier]
            if leaving:
                pipe.srem(self.keys.worker_tier_blocks(self.worker_id, tier), *leaving)
            if entering:
                pipe.sadd(self.keys.worker_tier_blocks(self.worker_id, tier), *entering)
        for block in removed:
            pipe.hdel(self.keys.block(block), self.worker_id)
        for block in stored:
            pipe.hset(self.keys.block(block), self.worker_id, self._epoch)
        if removed:
            pipe.srem(self.keys.worker_blocks(self.worker_id), *removed)
        if stored:
            pipe.sadd(self.keys.worker_blocks(self.worker_id), *stored)
        number = self._published + 1
        self._event(pipe, op="update", q=number, r=_joined(removed), s=_joined(stored))
        pipe.execute()
        self._published = number
        return True

    def _beat_once(self, client) -> int:
        return int(self._beat(keys=self._beat_keys(), args=self._beat_args(), client=client))

    def _rewrite(self, client, hashes: list[int]) -> int:
        # A zombie (superseded epoch) must not overwrite the live incarnation's entries, hence
        # the check first; the rewrite itself is one MULTI so lookups never see half a set.
        if int(self._beat(keys=self._beat_keys(), args=self._beat_args(), client=client)) == -1:
            return -1
        pipe = client.pipeline(transaction=True)
        self._drop(
            keys=[self.keys.worker_blocks(self.worker_id)],
            args=[self.keys.block_prefix, self.worker_id],
            client=pipe,
        )
        for block in hashes:
            pipe.hset(self.keys.block(block), self.worker_id, self._epoch)
        if hashes:
            pipe.sadd(self.keys.worker_blocks(self.worker_id), *hashes)
        for tier in LOWER_TIERS:
            key = self.keys.worker_tier_blocks(self.worker_id, tier)
            pipe.delete(key)
            in_tier = sorted(h for h, t in self._tier.items() if t == tier)
            if in_tier:
                pipe.sadd(key, *in_tier)
        self._beat(keys=self._beat_keys(), args=self._beat_args(), client=pipe)
        self._event(pipe, op="reset")
        pipe.execute()
        self._published = 0
        return 1

    def _event(self, pipe, **fields: object) -> None:
        """Appends this write to the event stream, in the same pipeline (schema.py)."""
        fields = {"w": self.worker_id, "e": self._epoch, **fields}
        pipe.xadd(self.keys.events, fields, maxlen=EVENTS_MAXLEN, approximate=True)

    def _beat_keys(self) -> list[str]:
        return [self.keys.heartbeat(self.worker_id), self.keys.workers]

    def _beat_args(self) -> list[str]:
        return [self.worker_id, self._epoch or "0", str(int(self.heartbeat_ttl_s * 1000))]

    def _lost_sync(self) -> None:
        self.needs_resync = True  # events published during the outage never reached Redis

    def _failed(self, result: int | None) -> bool:
        """Whether a script run failed: Redis unreachable (None; resynchronise later) or this
        epoch superseded by a newer one (-1; stop publishing)."""
        if result is None:
            self.needs_resync = True
        elif result == -1:
            self._fence()
        return result is None or result == -1

    def _fence(self) -> None:
        self.fenced = True
        log.error(
            "prefix index: worker %s epoch %s was superseded by a newer epoch; not publishing",
            self.worker_id,
            self._epoch,
        )


def _joined(hashes: list[int]) -> str:
    return ",".join(map(str, hashes))
