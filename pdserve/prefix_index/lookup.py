"""PrefixIndex: the router's view of which worker holds how much of a prompt's prefix (Redis).

Workers write the index (pdserve/prefix_index/publisher.py); the layout is pdserve/prefix_index/schema.py.
`lookup` answers, in one round trip, each live worker's cached leading blocks. No method raises
on a Redis outage: lookups return {} ("unknown"), `available` turns False and routing goes on
load alone; the first call that succeeds after the outage turns it back (workers resync
themselves on their next heartbeat).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.prefix_index.redis_link import RedisLink
from pdserve.prefix_index.reuse_stats import ModelReuse, add_reuse, parse_reuse
from pdserve.prefix_index.schema import IndexKeys

# Walks the prompt's chained block hashes in order and counts, for each worker holding the first
# block in its live epoch, how many leading blocks it holds. A worker leaves the walk at its
# first missing block (chained hashes: a later block without the earlier ones is useless).
# KEYS = block keys in prompt order; ARGV[1] = heartbeat key prefix.
# Returns {worker, count, worker, count, ...}.
LOOKUP_LUA = """
local names, epochs, counts, active = {}, {}, {}, {}
local first = redis.call('HGETALL', KEYS[1])
for j = 1, #first, 2 do
  local worker, epoch = first[j], first[j + 1]
  if redis.call('GET', ARGV[1] .. worker) == epoch then
    names[#names + 1] = worker
    epochs[#names] = epoch
    counts[#names] = 1
    active[#active + 1] = #names
  end
end
for k = 2, #KEYS do
  if #active == 0 then break end
  local fields = {}
  for i, idx in ipairs(active) do fields[i] = names[idx] end
  local values = redis.call('HMGET', KEYS[k], unpack(fields))
  local still = {}
  for i, idx in ipairs(active) do
    if values[i] == epochs[idx] then
      counts[idx] = counts[idx] + 1
      still[#still + 1] = idx
    end
  end
  active = still
end
local out = {}
for i = 1, #names do
  out[#out + 1] = names[i]
  out[#out + 1] = counts[i]
end
return out
"""


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
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.keys = IndexKeys(model, namespace)
        self.link = RedisLink(redis_url, name="router", socket_timeout_s=socket_timeout_s)
        self._lookup = self.link.client.register_script(LOOKUP_LUA)

    @property
    def available(self) -> bool:
        """False while Redis is unreachable: lookups answer {} then, meaning "unknown"."""
        return self.link.available

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """worker_id -> number of leading blocks of `block_hashes` it holds (workers holding none
        are absent). `block_hashes` are chained (pdserve.core.block_hash.prompt_block_hashes)."""
        if not block_hashes:
            return {}
        keys = [self.keys.block(h) for h in block_hashes]
        args = [self.keys.heartbeat_prefix]
        flat = self.link.call(lambda client: self._lookup(keys=keys, args=args, client=client), [])
        return {str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

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
            registered = client.hgetall(self.keys.workers)
            names = sorted(registered)
            if not names:
                return {}
            beats = client.mget([self.keys.heartbeat(w) for w in names])
            return {w: int(b) for w, b in zip(names, beats, strict=True) if b == registered[w]}

        return self.link.call(read, {})

    def close(self) -> None:
        self.link.close()
