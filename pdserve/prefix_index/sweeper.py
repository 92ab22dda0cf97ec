"""IndexSweeper: deletes prefix-index entries that no lookup counts, a bounded amount per round.

Lookups already ignore an entry whose worker has no heartbeat in the entry's epoch, so this is
about memory, not correctness: without it a dead worker's entries would stay in Redis forever.

Why a sweep from the router and not TTLs on the block keys: a block key is a HASH shared by every
worker holding that block, and the bundled Redis (6.2) cannot expire single hash fields. A TTL on
the whole key would have to be refreshed by every holder for every block it holds, i.e. each
worker rewriting O(its blocks) keys per heartbeat, forever, to save work that is only needed
when a worker dies. The sweep costs nothing while every worker is alive and a bounded amount
per round when one is not, in one process (the router) instead of every worker.

One `sweep()` round:
1. Dead workers: for each registered worker whose heartbeat key is gone, pop up to the round's
   remaining `batch` hashes from its block set and delete its field in those block keys; once
   its set is empty the worker is forgotten. Each step is one script that first re-checks the
   heartbeat, so a worker that comes back (and resynchronises atomically) is never touched.
2. Stale entries: one SCAN step (COUNT `scan_count`) over the model's block keys, deleting the
   fields whose epoch is not their worker's live one (a superseded incarnation's late writes,
   entries whose block set was lost). A full pass over the keyspace takes many rounds; dead
   workers do not wait for it, step 1 finds them directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.prefix_index.lookup import PrefixIndex
from pdserve.prefix_index.schema import LOWER_TIERS

# One step of removing a dead worker. KEYS[1] = its heartbeat key, KEYS[2] = its block set,
# KEYS[3] = workers hash; ARGV = block key prefix, worker id, how many hashes at most.
# Returns {entries removed, 1 if the worker was forgotten else 0}; {-1, 0} when the heartbeat
# exists (the worker is alive again: nothing touched).
DROP_DEAD_STEP_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {-1, 0} end
local hashes = redis.call('SPOP', KEYS[2], tonumber(ARGV[3]))
for _, h in ipairs(hashes) do
  redis.call('HDEL', ARGV[1] .. h, ARGV[2])
end
if redis.call('SCARD', KEYS[2]) > 0 then return {#hashes, 0} end
redis.call('HDEL', KEYS[3], ARGV[2])
return {#hashes, 1}
"""

# Deletes, in the given block keys, every field whose epoch is not its worker's live heartbeat
# epoch, and the hash from that worker's block set. KEYS = block keys; ARGV = heartbeat prefix,
# worker-blocks prefix, block key prefix. Returns the number of fields deleted.
DROP_STALE_LUA = """
local removed = 0
for _, key in ipairs(KEYS) do
  local fields = redis.call('HGETALL', key)
  for j = 1, #fields, 2 do
    local worker, epoch = fields[j], fields[j + 1]
    if redis.call('GET', ARGV[1] .. worker) ~= epoch then
      redis.call('HDEL', key, worker)
      redis.call('SREM', ARGV[2] .. worker, string.sub(key, #ARGV[3] + 1))
      removed = removed + 1
    end
  end
end
return removed
"""

GLOB_SPECIAL = "\\*?[]"


@dataclass(frozen=True)
class SweepRound:
    """What one round removed."""

    dead_entries: int = 0  # entries of workers without a heartbeat (step 1)
    forgotten_workers: int = 0  # dead workers whose last entries went this round
    stale_entries: int = 0  # entries of a non-live epoch found by the scan (step 2)
    pass_complete: bool = False  # the scan reached the end of the keyspace this round


class IndexSweeper:
    """Garbage collection of one model's index; `sweep()` is one bounded round. Not
    thread-safe: one sweeper per model, called from one thread (IndexMaintenance)."""

    def __init__(self, index: PrefixIndex, *, batch: int = 1000, scan_count: int = 1000) -> None:
        if batch < 1 or scan_count < 1:
            raise ValueError(f"batch and scan_count must be >= 1, got {batch}, {scan_count}")
        self.index = index
        self.batch = batch
        self.scan_count = scan_count
        self.keys = index.keys
        self._cursor = 0
        self._drop_dead = index.link.client.register_script(DROP_DEAD_STEP_LUA)
        self._drop_stale = index.link.client.register_script(DROP_STALE_LUA)
        self._pattern = _glob_escape(self.keys.block_prefix) + "*"

    def sweep(self) -> SweepRound:
        """One round; does nothing (and never raises) while Redis is unreachable."""
        dead, forgotten = self.index.link.call(self._drop_dead_workers, (0, 0))
        stale, complete = self.index.link.call(self._scan_step, (0, False))
        return SweepRound(dead, forgotten, stale, complete)

    def _drop_dead_workers(self, client) -> tuple[int, int]:
        registered = sorted(client.hkeys(self.keys.workers))
        if not registered:
            return 0, 0
        beats = client.mget([self.keys.heartbeat(w) for w in registered])
        budget, removed, forgotten = self.batch, 0, 0
        for worker, beat in zip(registered, beats, strict=True):
            if budget <= 0:
                break  # the rest waits for the next round
            if beat is not None:
                continue
            keys = [self.keys.heartbeat(worker), self.keys.worker_blocks(worker), self.keys.workers]
            args = [self.keys.block_prefix, worker, budget]
            count, gone = self._drop_dead(keys=keys, args=args, client=client)
            if count < 0:
                continue  # it heartbeat again meanwhile
            if gone:  # which of its blocks were in host memory or on disk: nothing to know
                for tier in LOWER_TIERS:
                    client.delete(self.keys.worker_tier_blocks(worker, tier))
            removed, budget, forgotten = removed + count, budget - count, forgotten + gone
        return removed, forgotten

    def _scan_step(self, client) -> tuple[int, bool]:
        cursor, block_keys = client.scan(self._cursor, match=self._pattern, count=self.scan_count)
        self._cursor = int(cursor)
        removed = 0
        if block_keys:
            args = [
                self.keys.heartbeat_prefix,
                self.keys.worker_blocks_prefix,
                self.keys.block_prefix,
            ]
            removed = int(self._drop_stale(keys=block_keys, args=args, client=client))
        return removed, self._cursor == 0


def _glob_escape(text: str) -> str:
    """`text` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return "".join("\\" + ch if ch in GLOB_SPECIAL else ch for ch in text)
