"""PrefixIndex: the router's view of which worker holds how much of a prompt's prefix (Redis).

Workers write the index (pdserve/prefix_index/publisher.py); the layout is pdserve/prefix_index/schema.py.
`lookup` answers, in one round trip, each live worker's cached leading blocks; with `mirror` on,
from the router's own copy of the index (mirror.py) once that is built. No method raises
on a Redis outage: lookups return {} ("unknown"), `available` turns False and routing goes on
load alone; the first call that succeeds after the outage turns it back (workers resync
themselves on their next heartbeat).

The router is one asyncio event loop streaming every client's tokens, so it never blocks that
loop on Redis: `lookup_async` awaits the lookup through the loop's asyncio client, and
statistics writes go to the index's writer thread (`in_background`). A round trip (~0.3-1 ms, a
socket timeout when Redis has just gone) then delays only the request being routed, not every
stream.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from pdserve.prefix_index.mirror import IndexMirror
from pdserve.prefix_index.redis_link import RedisLink
from pdserve.prefix_index.reuse_stats import ModelReuse, add_reuse, parse_reuse
from pdserve.prefix_index.schema import LIVENESS_LUA, IndexKeys, parse_liveness

log = logging.getLogger(__name__)

# Statistics writes queued behind a slow Redis before new ones are dropped (counted and logged):
# a bound on the memory they hold; they are counts, not requests.
MAX_QUEUED_WRITES = 10_000

# Counts, for each worker holding the prompt's first block in its live epoch, how many leading
# blocks it holds. A worker's blocks are prefix-closed (engine/block_manager.py: a block is cached
# only while its parent is, and evicted after the blocks that extend it), so holding block i means
# holding blocks 0..i, and each count is found by bisection: `search(lo, hi, workers)` knows that
# these workers hold block lo and not block hi, reads the block halfway and splits them. A 256-block
# prompt costs ~2 reads per distinct count and bisection level, not one per block (a system prompt's
# blocks each hold 150 workers: reading them all was most of a lookup's Redis CPU). A block is first
# compared whole with block lo (DUMP: a byte image of the hash, made in C): equal images mean the
# same holders in the same epochs, at O(1) in Lua. Else its entries are read, with HMGET for a few
# workers, else HGETALL (Redis keeps hashes of up to 128-512 fields as a listpack, where HMGET of F
# fields scans the list F times). A cold prompt costs one HGETALL.
# KEYS[1] = the first block's key; ARGV[1] = block key prefix, ARGV[2] = heartbeat key prefix,
# ARGV[3] = the hashes of the following blocks, each right-aligned in HASH_WIDTH characters,
# so block i is read at a fixed offset, without parsing them all. Their keys are built here:
# the names of 256 keys cost the router more to send than the lookup costs Redis, and they
# share KEYS[1]'s hash tag, so they live in its Redis Cluster slot (schema.py).
# Returns {"worker": count, ...} as one JSON string: redis-py parses a reply in Python, ~1 us per
# element, so a system prompt's 150 holders as a flat array cost the router more than the
# lookup costs Redis; one string is parsed by the json module's C decoder.
HASH_WIDTH = 19  # digits of the largest block hash, 2**63 - 1
LOOKUP_LUA = """
local first = redis.call('HGETALL', KEYS[1])
if #first == 0 then return '{}' end
local names, beats = {}, {}
for j = 1, #first, 2 do
  names[#names + 1] = first[j]
  beats[#beats + 1] = ARGV[2] .. first[j]
end
local live = redis.call('MGET', unpack(beats))
-- Workers are sets, {name = true}, with their size passed beside them.
local epoch, active, n = {}, {}, 0
for i = 1, #names do
  if live[i] == first[2 * i] then
    epoch[names[i]] = live[i]
    active[names[i]] = true
    n = n + 1
  end
end
if n == 0 then return '{}' end
local rest = ARGV[3]
local blocks = #rest / HASH_WIDTH + 1
local function key(i)
  if i == 0 then return KEYS[1] end
  return ARGV[1] .. string.match(string.sub(rest, HASH_WIDTH * (i - 1) + 1, HASH_WIDTH * i), '%d+')
end
local images = {}
local function image(i)
  local v = images[i]
  if v == nil then
    v = redis.call('DUMP', key(i)) or false
    images[i] = v
  end
  return v
end
-- Moves the workers of `set` holding block i into a new set, returned with its size: the cost
-- is the block's entries, not the set's size (a system prompt's 150 holders are split again
-- at every level of the bisection, by blocks that only a conversation's 1-3 holders hold).
local function split(i, set, size)
  local k, held, moved = key(i), {}, 0
  if size <= 8 then
    local ask = {}
    for w in pairs(set) do ask[#ask + 1] = w end
    local values = redis.call('HMGET', k, unpack(ask))
    for j = 1, #ask do
      if values[j] then
        held[#held + 1] = ask[j]
        held[#held + 1] = values[j]
      end
    end
  else
    held = redis.call('HGETALL', k)
  end
  local yes = {}
  for j = 1, #held, 2 do
    local w = held[j]
    if set[w] and held[j + 1] == epoch[w] then
      yes[w], set[w], moved = true, nil, moved + 1
    end
  end
  return yes, moved
end
local count = {}
-- Every worker of `set` holds block lo and not block hi.
local function search(lo, hi, set, size)
  if size == 0 then return end
  if hi - lo == 1 then
    for w in pairs(set) do count[w] = hi end
    return
  end
  local mid = math.floor((lo + hi) / 2)
  local seen = image(mid)
  if seen and seen == image(lo) then return search(mid, hi, set, size) end
  local yes, moved = split(mid, set, size)
  search(mid, hi, yes, moved)
  search(lo, mid, set, size - moved)
end
if blocks == 1 then
  search(0, 1, active, n)
else
  local whole, moved = split(blocks - 1, active, n)
  for w in pairs(whole) do count[w] = blocks end
  search(0, blocks - 1, active, n - moved)
end
return cjson.encode(count)
""".replace("HASH_WIDTH", str(HASH_WIDTH))
_HASH_FORMAT = f"%{HASH_WIDTH}d"


class PrefixIndex:
    """Router side of the prefix index for one model. Thread-safe (redis-py's pool is)."""

    def __init__(
        self,
        redis_url: str,
        model: str,
        block_size: int,
        *,
        namespace: str = "pdserve",
        socket_timeout_s: float = 0.3,
        mirror: bool = False,
    ) -> None:
        """`mirror`: answer lookups from a copy of the index in this process, fed by the event
        stream, instead of one Redis round trip each (mirror.py)."""
        self.model = model
        self.block_size = block_size
        self.keys = IndexKeys(model, namespace)
        self.link = RedisLink(redis_url, name="router", socket_timeout_s=socket_timeout_s)
        self._lookup = self.link.client.register_script(LOOKUP_LUA)
        self._liveness = self.link.client.register_script(LIVENESS_LUA)
        self._async_lookup = None  # the same script on the link's asyncio client
        self._writes_lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None  # made on first use
        self._queued_writes = 0
        self._closed = False  # writes after close() are dropped
        self.dropped_writes = 0
        self.mirror = IndexMirror(redis_url, self.keys).start() if mirror else None

    @property
    def available(self) -> bool:
        """False while Redis is unreachable: lookups answer {} then, meaning "unknown"."""
        return self.link.available

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """worker_id -> number of leading blocks of `block_hashes` it holds (workers holding none
        are absent). `block_hashes` are chained (pdserve.core.block_hash.prompt_block_hashes)."""
        found = self._answer_here(block_hashes)
        if found is not None:
            return found
        keys, args = self._lookup_arguments(block_hashes)
        reply = self.link.call(lambda client: self._lookup(keys=keys, args=args, client=client), "")
        return json.loads(reply) if reply else {}

    async def lookup_async(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """`lookup` awaited on the caller's event loop, which goes on serving meanwhile."""
        found = self._answer_here(block_hashes)
        if found is not None:
            return found
        keys, args = self._lookup_arguments(block_hashes)

        def run(client):  # EVALSHA, loading the script on NOSCRIPT (a restarted Redis)
            if self._async_lookup is None or self._async_lookup.registered_client is not client:
                self._async_lookup = client.register_script(LOOKUP_LUA)
            return self._async_lookup(keys=keys, args=args)

        reply = await self.link.acall(run, "")
        return json.loads(reply) if reply else {}

    def tier_blocks(self, worker_id: str, block_hashes: Sequence[int], tier: str) -> int:
        """How many of `block_hashes` (a worker's hit, from `lookup`) it holds in `tier`,
        "host" (--kv-offload-gb) or "disk" (--kv-disk-dir), rather than in its device pool; 0
        when Redis is unreachable. As a device cache is prefix-closed, the host's and disk's
        are the last ones of the hit."""
        if not block_hashes:
            return 0
        key = self.keys.worker_tier_blocks(worker_id, tier)
        members = self.link.call(lambda client: client.smismember(key, list(block_hashes)), [])
        return sum(map(int, members))

    def _answer_here(self, block_hashes: Sequence[int]) -> dict[str, int] | None:
        """The answer without asking Redis (the router's copy, or an empty prompt); None when
        only the lookup script can give it."""
        if not block_hashes:
            return {}
        return self.mirror.lookup(block_hashes) if self.mirror is not None else None

    def _lookup_arguments(self, block_hashes: Sequence[int]) -> tuple[list[str], list[str]]:
        keys = [self.keys.block(block_hashes[0])]
        rest = block_hashes[1:]
        fixed_width = (_HASH_FORMAT * len(rest)) % tuple(rest)  # one C call
        return keys, [self.keys.block_prefix, self.keys.heartbeat_prefix, fixed_width]

    def in_background(self, write: Callable[..., None], *args: object) -> None:
        """Runs `write(*args)`, a statistics write that never raises (it goes through `link`),
        on the index's writer thread, after the ones queued before it; returns at once.
        `close()` runs the queued ones first."""
        with self._writes_lock:
            if self._closed:
                return
            if self._queued_writes >= MAX_QUEUED_WRITES:
                self.dropped_writes += 1
                if self.dropped_writes == 1:
                    log.warning("prefix index: Redis is slow, statistics writes are dropped")
                return
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, "prefix-index-writes")
            self._queued_writes += 1
            self._writer.submit(self._write, write, args)

    def _write(self, write: Callable[..., None], args: tuple[object, ...]) -> None:
        try:
            write(*args)
        except Exception:  # a write is statistics: it must not end the writer
            log.exception("prefix index: statistics write failed")
        finally:
            with self._writes_lock:
                self._queued_writes -= 1

    def publish_plan(self, plan: dict) -> None:
        """Stores the online planner's latest plan for `pdserve stats` (best effort)."""
        text = json.dumps(plan)
        self.link.call(lambda client: client.set(self.keys.plan, text), None)

    def record_reuse(self, worker_id: str, hit_tokens: int, miss_tokens: int) -> None:
        """Adds one request's prompt tokens served from cache (hit) and computed (miss)."""

        def add(client) -> None:
            pipe = client.pipeline(transaction=False)
            add_reuse(pipe, self.keys, worker_id, hit_tokens, miss_tokens)
            pipe.execute()

        self.link.call(add, None)

    def stats(self) -> ModelReuse:
        """This model's reuse counters (all zero while Redis is unreachable)."""
        fields = self.link.call(lambda client: client.hgetall(self.keys.reuse), {})
        return parse_reuse(self.model, fields)

    def live_workers(self) -> dict[str, int]:
        """worker_id -> epoch of every worker whose heartbeat is current."""

        def read(client) -> dict[str, int]:
            reply = self._liveness(
                keys=[self.keys.workers], args=[self.keys.heartbeat_prefix], client=client
            )
            registered, live = parse_liveness(reply)
            return {w: int(registered[w]) for w in live}

        return self.link.call(read, {})

    def close(self) -> None:
        """Runs the queued statistics writes, then closes the connections (an event loop's
        asyncio client: `aclose`)."""
        with self._writes_lock:
            writer, self._writer, self._closed = self._writer, None, True
        if writer is not None:
            writer.shutdown(wait=True)
        if self.mirror is not None:
            self.mirror.stop()
        self.link.close()

    async def aclose(self) -> None:
        """`close`, and the running loop's asyncio client."""
        await self.link.aclose()
        self.close()
