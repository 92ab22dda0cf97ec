"""The prefix index's layout in Redis: the contract between workers (writers) and the router.

All keys of one model share the hash tag `{model}`, so they live in one Redis Cluster slot and
the Lua scripts may touch any of them (the lookup builds a prompt's block keys from its hashes
and declares only the first). With namespace "pdserve" and model "m":

  pdserve:{m}:blk:<hash>      HASH  worker_id -> epoch        who holds the block with that hash
  pdserve:{m}:wblk:<worker>   SET   block hashes               what one worker published (cleanup)
  pdserve:{m}:whost:<worker>  SET   block hashes               those of them in its host memory
                                                               (--kv-offload-gb)
  pdserve:{m}:wdisk:<worker>  SET   block hashes               those of them in its disk tier
                                                               (--kv-disk-dir); the rest are
                                                               in its device KV pool
  pdserve:{m}:hb:<worker>     STR   epoch, with a TTL          the worker is alive in that epoch
  pdserve:{m}:workers         HASH  worker_id -> epoch        newest epoch ever registered
  pdserve:{m}:reuse           HASH  hit_tokens, miss_tokens, requests, w:<worker>:<counter>
  pdserve:{m}:spec            HASH  draft_tokens, accepted_tokens, verify_steps, w:<worker>:<counter>
  pdserve:{m}:plan            STR   JSON: the online planner's latest plan (--plan-interval)
  pdserve:{m}:events          STREAM the writes above as events, for routers' mirrors (below)
  pdserve:models              SET   model names with reuse statistics

An entry counts only while the worker's heartbeat key exists and holds the entry's epoch, so a
restarted worker's old entries and a dead worker's entries stop counting at once, before any
cleanup (the router's sweeper.py deletes them later). Epochs are non-negative integers,
compared as numbers; a newer one fences older ones.

The event stream repeats each worker write in order, so that a router can keep the index in its
own memory (mirror.py) instead of asking Redis per decision. Entry fields: `w` worker, `e` epoch
and `op`:
  "update"  `q` the worker's publish number in this epoch (1, 2, ...: a gap means lost entries),
            `r` removed and `s` stored hashes, comma-separated, applied in that order;
  "reset"   the worker's block set was rewritten (a new epoch, or a resync): read it again;
  "drop"    the worker unregistered: its entries are gone.
Redis trims the stream to about EVENTS_MAXLEN entries; a reader that falls further behind sees
a gap in some worker's `q` (or, after a Redis restart, an error) and reads that state again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Removes every block entry a worker published (any epoch) and its block set.
# KEYS[1] = the worker's block set; ARGV[1] = block key prefix; ARGV[2] = worker id.
DROP_WORKER_LUA = """
local hashes = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(hashes) do
  redis.call('HDEL', ARGV[1] .. h, ARGV[2])
end
redis.call('DEL', KEYS[1])
return #hashes
"""

# Records that a worker is alive in an epoch. Returns -1 when a newer epoch of the same worker
# is registered (this process is a zombie and must stop writing), 1 when the previous heartbeat
# of this epoch was still there, 0 when it was gone (Redis restarted, or the TTL passed): the
# worker's entries may be missing and it must resynchronise.
# KEYS[1] = heartbeat key, KEYS[2] = workers hash; ARGV = worker id, epoch, ttl in ms.
HEARTBEAT_LUA = """
local function newer(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local registered = redis.call('HGET', KEYS[2], ARGV[1])
if registered and newer(registered, ARGV[2]) then return -1 end
local previous = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if previous == ARGV[2] then return 1 end
return 0
"""

# Which workers count: the registered ones (worker -> epoch) and those whose heartbeat holds
# their registered epoch, as one JSON string `[{worker: epoch}, [live worker, ...]]` (an empty
# list may come back as `{}`), read by the router twice a second: parsing the same answer as
# a hash and a list of heartbeats, ~1000 items at 256 workers, held the router's GIL ~1 ms.
# KEYS[1] = workers hash; ARGV[1] = heartbeat key prefix.
LIVENESS_LUA = """
local registered = redis.call('HGETALL', KEYS[1])
local epochs, keys = {}, {}
for i = 1, #registered, 2 do
  epochs[registered[i]] = registered[i + 1]
  keys[#keys + 1] = ARGV[1] .. registered[i]
end
local live = {}
if #keys > 0 then
  local beats = redis.call('MGET', unpack(keys))
  for i = 1, #registered, 2 do
    if beats[(i + 1) / 2] == registered[i + 1] then live[#live + 1] = registered[i] end
  end
end
return cjson.encode({epochs, live})
"""


def parse_liveness(reply: str | bytes) -> tuple[dict[str, str], list[str]]:
    """LIVENESS_LUA's answer: (registered worker -> epoch, the live workers)."""
    registered, live = json.loads(reply)
    return registered, list(live)


# ~8 s of a 256-worker cluster's publishes at ~10 per worker per second (BENCHMARKS.md, the
# control plane's publishing load), ~2 kB each: ~40 MB of Redis memory at most.
EVENTS_MAXLEN = 20_000


# The tiers below the device pool that the index lists per worker (core/kv_events.py), and
# their key names.
LOWER_TIERS = ("host", "disk")
_TIER_KEYS = {"host": "whost:", "disk": "wdisk:"}


@dataclass(frozen=True)
class IndexKeys:
    """Key names of one model's index (see the module docstring)."""

    model: str
    namespace: str = "pdserve"

    def __post_init__(self) -> None:
        if not self.model or "{" in self.model or "}" in self.model:
            raise ValueError(
                f"model name for the prefix index must be non-empty, no braces: {self.model!r}"
            )

    @property
    def base(self) -> str:
        return f"{self.namespace}:{{{self.model}}}:"

    @property
    def block_prefix(self) -> str:
        return self.base + "blk:"

    @property
    def heartbeat_prefix(self) -> str:
        return self.base + "hb:"

    def block(self, block_hash: int) -> str:
        return f"{self.block_prefix}{block_hash}"

    def heartbeat(self, worker_id: str) -> str:
        return self.heartbeat_prefix + worker_id

    @property
    def worker_blocks_prefix(self) -> str:
        return self.base + "wblk:"

    def worker_blocks(self, worker_id: str) -> str:
        return self.worker_blocks_prefix + worker_id

    def worker_tier_blocks(self, worker_id: str, tier: str) -> str:
        """The worker's blocks held in a tier below its device pool, "host" or "disk" (a
        subset of its block set; the tiers' sets are disjoint)."""
        return self.base + _TIER_KEYS[tier] + worker_id

    @property
    def workers(self) -> str:
        return self.base + "workers"

    @property
    def reuse(self) -> str:
        return self.base + "reuse"

    @property
    def plan(self) -> str:
        """The online planner's latest plan (JSON), for `pdserve stats`."""
        return self.base + "plan"

    @property
    def events(self) -> str:
        return self.base + "events"

    @property
    def models(self) -> str:
        return f"{self.namespace}:models"


def epoch_str(epoch: int) -> str:
    """The canonical text of an epoch (the Lua scripts compare these strings)."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return str(int(epoch))
