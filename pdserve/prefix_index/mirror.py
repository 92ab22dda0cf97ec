"""IndexMirror: the prefix index kept in the router's memory, fed by the workers' event stream.

Asking Redis per routing decision costs a round trip (~0.9 ms at 1M indexed blocks) plus Redis
CPU (the lookup script bisects a prompt's blocks: ~0.2 ms per 4096-token lookup at 200k blocks,
0.4-0.6 ms at 1M; BENCHMARKS.md), so one Redis core also bounds the cluster's decisions/s.
Dynamo's KV router keeps the index in the router instead, fed by the workers' KV events; this
does the same with the events the publishers append to the index's stream (schema.py). Redis
stays the durable index: a mirror builds itself from it at start, after a Redis outage or
restart, and for one worker whenever that worker's events show a gap.

Answers equal the Redis lookup's (`tests/prefix_index/test_mirror.py` compares the two):
an entry counts while its worker's heartbeat holds the entry's epoch, and liveness is read from
Redis every `liveness_s` seconds, so a dead worker stops counting within that time (the Redis
lookup sees it at once; the router's own health checks see it too). Events reach the mirror a
reader-thread wake-up after Redis has them (~1 ms); the router's recent prefixes cover what it
just routed anyway.

Threads: one reader thread writes, the event loop reads. A lookup reads a block's holders as one
int (a bit per worker), which the reader replaces whole, so it never sees a torn entry, only an
older or newer one, as it would from Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

import redis

from pdserve.metrics import INDEX_MIRROR_EVENTS, INDEX_MIRROR_READS, INDEX_MIRROR_UP
from pdserve.prefix_index.redis_link import connect
from pdserve.prefix_index.schema import LIVENESS_LUA, IndexKeys, parse_liveness

log = logging.getLogger(__name__)

# The reader thread holds the GIL while it parses and applies what it read, and the router's
# event loop, wanting it back, waits that long: with 20k blocks/s of events (~70 us of work per
# 128-block entry) a read held it ~0.5 ms at p50 and ~3 ms at p99 on this 2-core VM, and a
# decision's p99 grew by 1-2 ms. So a read takes a few entries, and the thread offers the GIL
# back once it has held it HOLD_S (`time.sleep(0)`: a ~50 us nap, the kernel's timer slack,
# in which a waiting thread takes it), checked after each entry and every HOLD_CHECK hashes of
# a worker's reload. A loop that never waits hands the GIL over only every
# `sys.getswitchinterval()` (5 ms; and whenever numpy runs a large array op), so ~0.1 ms per
# 5 ms can fall behind a busy stream. Once BEHIND_AFTER_READS reads in a row came back full
# (more was waiting each time: the copy is not catching up), the thread holds BEHIND_HOLD_S
# instead, and catches up at the decisions' expense; a burst of events does not.
EVENTS_PER_READ = 16
HOLD_S = 0.0001
BEHIND_HOLD_S = 0.0005
BEHIND_AFTER_READS = 8
HOLD_CHECK = 256
# The copy's block table is split by hash into this many dicts: a dict grows by rebuilding
# itself whole, with the GIL held, and one of a million entries takes ~35 ms to rebuild, a stall
# of the router's event loop; one of 1/256th of them takes ~0.1 ms.
SHARDS = 256
RETRY_S = 0.5  # after a failed read: the mirror answers nothing meanwhile (Redis is down)


class IndexMirror:
    def __init__(
        self,
        redis_url: str,
        keys: IndexKeys,
        *,
        liveness_s: float = 0.5,
        socket_timeout_s: float = 2.0,
    ) -> None:
        if liveness_s <= 0 or socket_timeout_s <= liveness_s:
            raise ValueError("need 0 < liveness_s < socket_timeout_s (a read blocks liveness_s)")
        self.keys = keys
        self.liveness_s = liveness_s
        self._client = connect(redis_url, socket_timeout_s)
        self._liveness = self._client.register_script(LIVENESS_LUA)
        # block hash -> bits of the workers holding it here, in shard `hash % SHARDS`
        self._shards: list[dict[int, int]] = [{} for _ in range(SHARDS)]
        # worker -> the hashes it holds here, as dict keys: a dict of ints is not tracked by the
        # garbage collector, where a set is, and a full collection would walk all 2M entries
        # of a 1M-block index (~10 ms with the GIL held)
        self._held: dict[str, dict[int, None]] = {}
        self._epoch: dict[str, str] = {}  # worker -> the epoch of its entries here
        self._published: dict[str, int | None] = {}  # worker -> its last update's `q` (None: any)
        self._bit: dict[str, int] = {}  # worker -> its bit, while it is registered
        self._names: list[str] = []  # bit index -> worker
        self._live = 0  # bits of the workers whose heartbeat holds the epoch of their entries
        self._beats: dict[str, str] = {}  # worker -> epoch of its heartbeat, as last read
        self._free: list[int] = []  # bits of forgotten workers, for new ones
        self._last_id = "0-0"
        self._next_liveness = 0.0
        self._liveness_read_at = 0.0
        self._holding_since = 0.0  # when this thread last took the GIL back
        self._hold_s = HOLD_S  # how long it keeps it: longer while it is behind the stream
        self._full_reads = 0  # reads in a row that left more entries waiting
        self.ready = False  # built and reading; lookups answer None (ask Redis) until then
        self.events = 0  # stream entries applied
        self.builds = 0  # whole rebuilds from Redis (start, outages)
        self.reloads = 0  # one worker's state read again (a reset, a gap, a missed epoch)
        self._stopped = threading.Event()
        self._caught_up = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self) -> IndexMirror:
        self._thread = threading.Thread(target=self._run, name="index-mirror", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=self.liveness_s + 5)
        self.ready = False
        INDEX_MIRROR_UP.set(0)
        self._client.close()

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int] | None:
        """worker_id -> leading blocks of `block_hashes` it holds, as PrefixIndex.lookup answers;
        None while the mirror is not built (starting, or Redis unreachable)."""
        if not self.ready:
            return None
        if not block_hashes:
            return {}
        shards = self._shards
        first = block_hashes[0]
        walking = shards[first % SHARDS].get(first, 0) & self._live
        if not walking:
            return {}
        # As the Redis lookup does (lookup.py): a worker's blocks are prefix-closed, so holding
        # block i means holding blocks 0..i, and each worker's count is found by bisection, a
        # few reads per distinct count instead of one per block.
        last = len(block_hashes) - 1
        h = block_hashes[last]
        whole = shards[h % SHARDS].get(h, 0) & walking
        found: dict[str, int] = {}
        self._credit(found, whole, last + 1)
        pending = [(0, last, walking & ~whole)]  # (lo, hi, workers holding block lo, not hi)
        while pending:
            lo, hi, bits = pending.pop()
            if not bits:
                continue
            if hi - lo == 1:
                self._credit(found, bits, hi)
                continue
            mid = (lo + hi) // 2
            h = block_hashes[mid]
            holding = shards[h % SHARDS].get(h, 0) & bits
            pending.append((mid, hi, holding))
            pending.append((lo, mid, bits & ~holding))
        return found

    def _credit(self, found: dict[str, int], bits: int, depth: int) -> None:
        names = self._names
        while bits:
            low = bits & -bits
            found[names[low.bit_length() - 1]] = depth
            bits ^= low

    def wait_caught_up(self, timeout_s: float = 5.0) -> bool:
        """Waits until the mirror is built and has applied every event now in the stream and
        read liveness since (tests, benches). True when it has."""
        deadline = time.monotonic() + timeout_s
        try:
            newest = self._client.xrevrange(self.keys.events, count=1)
        except (redis.RedisError, OSError):
            return False
        target = newest[0][0] if newest else "0-0"
        asked = time.monotonic()
        with self._caught_up:
            return self._caught_up.wait_for(
                lambda: (
                    self.ready
                    and _stream_id(self._last_id) >= _stream_id(target)
                    and self._liveness_read_at > asked
                ),
                timeout=max(0.0, deadline - time.monotonic()),
            )

    # The reader thread.

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                if not self.ready:
                    self._build()
                self._read()
                if time.monotonic() >= self._next_liveness:
                    self._read_liveness()
            except (redis.RedisError, OSError) as exc:
                if self.ready:
                    log.warning("prefix index mirror: Redis unreachable, rebuilding (%s)", exc)
                self._drop_copy()
                continue
            except Exception:  # an entry this code cannot read: a stale copy must not stay
                log.exception("prefix index mirror: unreadable stream entry, rebuilding")
                self._drop_copy()
                continue
            with self._caught_up:
                self._caught_up.notify_all()

    def _drop_copy(self) -> None:
        """Lookups go to Redis until the next build (after RETRY_S), which starts after the
        stream's newest entry, so an unreadable one is skipped."""
        self.ready = False
        INDEX_MIRROR_UP.set(0)
        self._stopped.wait(RETRY_S)

    def _build(self) -> None:
        """Everything from Redis: the stream's position first, then each worker's block set, so
        the events after that position replay onto a state at least as new as it (each event
        sets or clears entries, so the replay ends where Redis is)."""
        newest = self._client.xrevrange(self.keys.events, count=1)
        self._hold_s = BEHIND_HOLD_S  # a catch-up: lookups ask Redis until it is done
        self._shards = [{} for _ in range(SHARDS)]
        self._held, self._epoch, self._published = {}, {}, {}
        self._live = 0
        self._last_id = newest[0][0] if newest else "0-0"
        self._read_liveness()  # loads every live worker
        self.builds += 1
        INDEX_MIRROR_READS.labels("build").inc()
        self.ready = True
        INDEX_MIRROR_UP.set(1)

    def _read(self) -> None:
        reply = self._client.xread(
            {self.keys.events: self._last_id},
            count=EVENTS_PER_READ,
            block=int(self.liveness_s * 1000),
        )
        self._holding_since = time.perf_counter()  # the GIL is taken back after the read
        read = sum(len(entries) for _stream, entries in reply or ())
        self._full_reads = self._full_reads + 1 if read == EVENTS_PER_READ else 0
        behind = self._full_reads >= BEHIND_AFTER_READS
        self._hold_s = BEHIND_HOLD_S if behind else HOLD_S
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._apply(fields)
                self._last_id = entry_id
                self.events += 1
                self._offer_gil()
            INDEX_MIRROR_EVENTS.inc(len(entries))

    def _apply(self, fields: dict[str, str]) -> None:
        """One stream entry (schema.py); an `op` this version does not know is ignored."""
        worker_id, epoch, op = fields["w"], fields["e"], fields["op"]
        known = self._epoch.get(worker_id)
        if known is not None and _newer(known, epoch):
            return  # a superseded incarnation's late write, which lookups ignore
        if op == "reset":  # written with a heartbeat of this epoch, in one transaction
            self._beats[worker_id] = epoch
            self._reload(worker_id, epoch)
        elif op == "drop":
            self._beats.pop(worker_id, None)
            self._unload(worker_id)
        elif known != epoch:  # an update of an epoch whose reset is not seen
            self._reload(worker_id, epoch)
        elif op == "update":
            number, last = int(fields["q"]), self._published.get(worker_id)
            if last is not None and number != last + 1:
                self._reload(worker_id, epoch)  # updates were trimmed away unread
                return
            self._published[worker_id] = number
            held, bit = self._held[worker_id], self._bit_of(worker_id)
            gone = [h for h in _hashes(fields["r"]) if h in held]
            for h in gone:
                del held[h]
            self._clear(bit, gone)
            new = [h for h in _hashes(fields["s"]) if h not in held]
            held.update(dict.fromkeys(new))
            self._set(bit, new)

    def _set(self, bit: int, hashes: Iterable[int]) -> None:
        shards = self._shards
        for chunk in _chunks(hashes):  # a worker's reload sets all its blocks
            for h in chunk:
                holders = shards[h % SHARDS]
                holders[h] = holders.get(h, 0) | bit
            self._offer_gil()

    def _clear(self, bit: int, hashes: Iterable[int]) -> None:
        shards, keep = self._shards, ~bit
        for chunk in _chunks(hashes):
            for h in chunk:
                holders = shards[h % SHARDS]
                rest = holders.get(h, 0) & keep
                if rest:
                    holders[h] = rest
                else:
                    holders.pop(h, None)
            self._offer_gil()

    def _offer_gil(self) -> None:
        """Lets a waiting thread (the event loop) run if this one has held the GIL long enough."""
        if time.perf_counter() - self._holding_since >= self._hold_s:
            time.sleep(0)
            self._holding_since = time.perf_counter()

    def _reload(self, worker_id: str, epoch: str) -> None:
        """The worker's entries as Redis has them now, for `epoch` (the events after this point
        replay onto them)."""
        members = dict.fromkeys(map(int, self._client.smembers(self.keys.worker_blocks(worker_id))))
        self._unload(worker_id)
        bit = self._bit_of(worker_id)
        self._epoch[worker_id] = epoch
        self._published[worker_id] = None  # its next update's number is not known
        self._held[worker_id] = members
        self._set(bit, members)
        if self._beats.get(worker_id) == epoch:
            self._live |= bit
        self.reloads += 1
        INDEX_MIRROR_READS.labels("worker").inc()

    def _unload(self, worker_id: str) -> None:
        bit = self._bit.get(worker_id)
        if bit is None:
            return
        self._live &= ~bit
        self._clear(bit, self._held.pop(worker_id, ()))
        self._epoch.pop(worker_id, None)
        self._published.pop(worker_id, None)

    def _read_liveness(self) -> None:
        """Which workers count: those whose heartbeat holds the epoch of their entries here.
        A worker without a live heartbeat is unloaded: it resynchronises (a reset event) when
        it beats again, as PrefixIndexPublisher.heartbeat does after a lapse. The bits of
        workers no longer registered are freed for new ones (their entries are gone)."""
        registered, live_workers = parse_liveness(
            self._liveness(keys=[self.keys.workers], args=[self.keys.heartbeat_prefix])
        )
        self._beats = {w: registered[w] for w in live_workers}
        for worker_id in [w for w in self._epoch if self._beats.get(w) != self._epoch[w]]:
            self._unload(worker_id)
        for worker_id, epoch in self._beats.items():
            if self._epoch.get(worker_id) != epoch:
                self._reload(worker_id, epoch)  # a registration whose reset is not read yet
        live = 0  # every loaded worker is live now
        for worker_id in self._epoch:
            live |= self._bit[worker_id]
        self._live = live  # one store: a lookup never sees a partial mask
        for worker_id in [w for w in self._bit if w not in registered and w not in self._epoch]:
            self._free.append(self._bit.pop(worker_id))
        self._liveness_read_at = time.monotonic()
        self._next_liveness = self._liveness_read_at + self.liveness_s

    def _bit_of(self, worker_id: str) -> int:
        bit = self._bit.get(worker_id)
        if bit is None:
            if self._free:
                bit = self._free.pop()
            else:
                self._names.append("")
                bit = 1 << (len(self._names) - 1)
            self._names[bit.bit_length() - 1] = worker_id  # before the bit is set anywhere
            self._bit[worker_id] = bit
        return bit


def _hashes(joined: str) -> list[int]:
    return list(map(int, joined.split(","))) if joined else []


def _chunks(hashes: Iterable[int]) -> Iterator[list[int]]:
    """`hashes` in lists of HOLD_CHECK."""
    it = iter(hashes)
    while chunk := list(islice(it, HOLD_CHECK)):
        yield chunk


def _newer(a: str, b: str) -> bool:
    """Whether epoch `a` is newer than epoch `b` (canonical decimal strings, schema.epoch_str)."""
    return (len(a), a) > (len(b), b)


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
