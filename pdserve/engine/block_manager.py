"""BlockManager: the KV blocks, their reference counts, and the prefix cache over them.

Every block is in exactly one state:
- free: ref 0, no contents worth keeping (in `_free`, FIFO);
- cached-evictable: ref 0 but registered under its hash (in `_evictable`, LRU order), so a
  later request with the same prefix reuses it; it is evicted only when a block is needed;
- used: ref > 0 (running, held or reserved sequences share it; hashed or not).
A full block is registered under `block_hash(parent, tokens)` once its K/V are computed; a hit
is also checked against the stored token ids, so a hash collision can never serve wrong KV.
Stores and evictions are queued as KVEvents; the engine drains them with `take_events()`.

The cache is prefix-closed: a block is registered only while its parent is, and evicting a
block first unregisters every cached block that extends it (children before parents in the
events). Such a block could never be hit anyway (`acquire_prefix` walks from the first block),
and the prefix index relies on it: a worker that holds a block holds every block before it,
so the router's lookup bisects instead of reading every block (prefix_index/lookup.py). Without
it a block computed twice at once (two requests on one new prefix) leaves a gap: the copy that
registered first is released and evicted while the other request's later blocks stay.

Forks (n samples, beams): `fork(parent, child)` gives the child every block of the parent, one
more reference each. A block is written only by a sequence that holds it alone:
`copy_on_write(seq, start, end)`, called before a step writes positions [start, end), swaps
each shared block there for a private copy and returns the copies for the executor to make.
Forked sequences write only after their common tokens, so only a partly filled last block is
ever copied, at most once per fork; full blocks are never copied.

With a host tier (host_tier.py, --kv-offload-gb) an evicted block is copied to host memory
instead of dropped (a "stored" event of tier "host": it moved, it is not gone), and a prefix
walk that misses the device cache brings host blocks back into free device blocks, which are
then device hits like any other. Under the host tier a disk tier (disk_tier.py, --kv-disk-dir)
takes what the host evicts, and the walk reads its blocks back the same way.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as PySequence

from pdserve.core.block_hash import ROOT_HASH, block_hash, prompt_block_hashes
from pdserve.core.kv_events import KVEvent, KVEventKind, KVTier
from pdserve.engine.host_tier import HostTier
from pdserve.engine.sequence import Sequence


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier: HostTier | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # hash -> block id
        self._parent: list[int | None] = [None] * num_blocks  # a registered block's parent hash
        self._children: dict[int, set[int]] = {}  # hash -> cached hashes that extend it
        self._events: list[tuple[KVEventKind, int, KVTier]] = []
        self.host_tier = host_tier if enable_prefix_caching else None

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request holds: counted free, taken by evicting their prefix."""
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def reset_prefix_cache(self) -> None:
        """Evicts every cached block no request holds, as a new pool would be (vLLM's
        reset_prefix_cache): a benchmark that serves the same requests twice starts both runs
        cold. Blocks requests hold stay theirs (and cached)."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._evict(block_id)
            self._free.append(block_id)

    # ---- sequence-level operations ------------------------------------------------------
    def acquire_prefix(self, seq: Sequence, max_tokens: int) -> int:
        """Gives a sequence with no blocks the longest cached run of full blocks within its
        first `max_tokens` tokens, bringing back those of the host and disk tiers (their tokens
        are `seq.num_host_hit_tokens`, `seq.num_disk_hit_tokens`); returns how many tokens that
        covers."""
        assert not seq.block_table, "prefix lookup is only for a sequence without blocks"
        seq.num_host_hit_tokens = seq.num_disk_hit_tokens = 0
        if not self.enable_prefix_caching:
            return 0
        parent = ROOT_HASH
        size = self.block_size
        prompt = self.prompt_hashes(seq)
        for start in range(0, max_tokens - size + 1, size):
            i = start // size
            token_ids = seq.token_ids[start : start + size]
            h = prompt[i] if i < len(prompt) else block_hash(parent, token_ids)
            block_id = self._cached.get(h)
            if block_id is not None and self._tokens[block_id] == tuple(token_ids):
                self._acquire(block_id)
            elif block_id is None and self.host_tier is not None:
                block_id, tier = self._restore(h, tuple(token_ids), parent)
                if block_id is None:
                    break
                if tier == "host":
                    seq.num_host_hit_tokens += size
                else:
                    seq.num_disk_hit_tokens += size
            else:
                break
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        return len(seq.block_table) * self.block_size

    def prompt_hashes(self, seq: Sequence) -> PySequence[int]:
        """Chained hashes of the full blocks of `seq`'s prompt (as `block_hash` chains them),
        computed once per sequence (or given with its prompt: PromptTokens)."""
        if seq.prompt_block_hashes is None:
            seq.prompt_block_hashes = prompt_block_hashes(
                seq.token_ids[: seq.num_prompt_tokens], self.block_size
            )
        return seq.prompt_block_hashes

    def queued_prompt_tokens(self, waiting: Iterable[Sequence]) -> int:
        """The prompt tokens `waiting` (in queue order) will compute: each sequence's
        uncomputed tokens less the leading full blocks it will find cached, in this pool or
        computed by a sequence queued ahead of it (the scheduler computes a shared prefix once).
        Counting whole prompts made a worker whose queue shares one cached tenant prefix look
        as busy as one computing them all, and the router moved turns off it, recomputing the
        prefix elsewhere (docs/benchmarks/routing.md, seventh part). The host and disk tiers
        are not counted: an estimate, and a hit there still costs its copy.

        A prompt's found blocks are a binary search: the cache never holds a block without its
        parent (`_evict` takes descendants first), nor does `ahead` (whole prompts), so along
        a prompt's chain of hashes the held ones come first. Stats are polled a few times a
        second, with queues of hundreds of thousand-block prompts."""
        total, ahead, cached = 0, set(), self._cached
        for seq in waiting:
            uncomputed = seq.num_uncomputed_tokens
            if seq.block_table or not self.enable_prefix_caching:
                total += uncomputed
                continue
            hashes = self.prompt_hashes(seq)
            found = bisect.bisect_left(
                range(len(hashes)),
                True,
                key=lambda i: hashes[i] not in cached and hashes[i] not in ahead,
            )
            total += max(1, uncomputed - found * self.block_size)
            ahead.update(hashes)
        return total

    def is_cached(self, block_hash_value: int) -> bool:
        """Whether a full block with this hash is in the prefix cache (tokens not checked)."""
        return block_hash_value in self._cached

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows the block table to hold `num_tokens` tokens; all or nothing."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._allocate_one() for _ in range(needed))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Shares every block of `parent` with `child` (which has none): references, not
        copies. The child's computed tokens must be the parent's (or a prefix of them)."""
        assert not child.block_table, "only a sequence without blocks can be forked into"
        for block_id in parent.block_table:
            self._ref[block_id] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def writable(self, seq: Sequence, start: int, end: int) -> bool:
        """Whether `seq` may write positions [start, end) as it is: its table already covers
        them and holds each of their blocks alone (then `ensure_blocks` and `copy_on_write`
        would change nothing). The scheduler's check for the usual decode step."""
        table, size = seq.block_table, self.block_size
        if end > len(table) * size:
            return False
        ref = self._ref
        first, last = start // size, (end - 1) // size
        if first == last:  # within one block, as every decode step: no loop to set up
            return ref[table[first]] <= 1
        for i in range(first, last + 1):  # noqa: SIM110 (no generator: hot path)
            if ref[table[i]] > 1:
                return False
        return True

    def copy_on_write(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]] | None:
        """Before a step writes the KV of positions [start, end) of `seq`: every block there
        that another sequence also holds is replaced in `seq`'s table by a fresh block; returns
        the (source, destination) pairs whose contents the executor must copy before the step.
        None, changing nothing, when there are not enough free blocks."""
        table, size = seq.block_table, self.block_size
        assert end <= len(table) * size, "copy_on_write comes after ensure_blocks"
        shared = [i for i in range(start // size, -(-end // size)) if self._ref[table[i]] > 1]
        if len(shared) > self.num_free_blocks:
            return None
        copies = []
        for i in shared:
            source = table[i]
            self._ref[source] -= 1  # still held by the other forks
            table[i] = self._allocate_one()
            copies.append((source, table[i]))
        return copies

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the blocks that became full and computed since the last call."""
        if not self.enable_prefix_caching or not seq.cache_blocks:
            return
        size, registered = self.block_size, len(seq.block_hashes)
        # Called for every sequence after every step: most often no block has filled since
        # (a decode step fills one in block_size steps), which this tells at the least cost.
        if seq.num_computed_tokens < (registered + 1) * size:
            return
        num_full = min(seq.num_computed_tokens // size, len(seq.block_table))
        if num_full <= registered:
            return
        # A prompt's blocks are hashed once per sequence (`prompt_hashes`), not block by block.
        prompt = self.prompt_hashes(seq) if registered < seq.num_prompt_tokens // size else ()
        cached = self._cached
        for i in range(registered, num_full):
            token_ids = seq.token_ids[i * size : (i + 1) * size]
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            h = prompt[i] if i < len(prompt) else block_hash(parent, token_ids)
            seq.block_hashes.append(h)
            block_id = seq.block_table[i]
            # Another block may already hold this prefix (computed concurrently); keep that
            # one and let this copy become plain free space when released. A block whose
            # parent left the cache stays out of it (the module docstring).
            if (
                h not in cached
                and self._hash[block_id] is None
                and (parent == ROOT_HASH or parent in cached)
            ):
                self._register(block_id, h, tuple(token_ids), parent)
                if self.host_tier is not None:
                    self.host_tier.discard(h)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drops the sequence's blocks past the first `num_tokens` tokens (rejected speculative
        drafts): never a block holding one of them, nor a registered full block."""
        keep = -(-num_tokens // self.block_size)
        assert keep >= len(seq.block_hashes), "truncate keeps every registered block"
        for block_id in reversed(seq.block_table[keep:]):
            self._drop(block_id)
        del seq.block_table[keep:]

    def release(self, seq: Sequence) -> None:
        """Drops the sequence's references. Blocks are released tail first, so under LRU the
        end of a prefix is evicted before its beginning (which more requests share)."""
        for block_id in reversed(seq.block_table):
            self._drop(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def take_events(
        self,
    ) -> list[KVEvent]:
        """Queued stores and evictions, consecutive ones of a kind and tier merged into one."""
        if self.host_tier is not None:  # disk writes end on their own thread
            self._events += self.host_tier.take_written()
        events: list[KVEvent] = []
        for kind, h, tier in self._events:
            if events and events[-1].kind == kind and events[-1].tier == tier:
                events[-1].block_hashes.append(h)
            else:
                events.append(KVEvent(kind, [h], 0, tier))
        self._events = []
        return [
            KVEvent(e.kind, e.block_hashes, len(e.block_hashes) * self.block_size, e.tier)
            for e in events
        ]

    # ---- single blocks ------------------------------------------------------------------
    def _register(self, block_id: int, h: int, token_ids: tuple[int, ...], parent: int) -> None:
        self._cached[h] = block_id
        self._hash[block_id] = h
        self._tokens[block_id] = token_ids
        self._parent[block_id] = parent
        if parent != ROOT_HASH:
            self._children.setdefault(parent, set()).add(h)
        self._events.append(("stored", h, "device"))

    def _restore(
        self, h: int, token_ids: tuple[int, ...], parent: int
    ) -> tuple[int | None, KVTier | None]:
        """A free device block (ref 1) holding the host or disk tier's copy of block `h`,
        registered in the device cache, and the tier it came from; None when neither holds it,
        its file failed its checks, or no block is free."""
        tier = self.host_tier
        if tier is None or not tier.holds(h, token_ids) or not self.num_free_blocks:
            return None, None
        block_id = self._allocate_one()  # may offload an evicted block, and so evict `h`
        source = None
        if tier.holds(h, token_ids):
            source, events = tier.restore(h, block_id)
            self._events += events
        if source is None:
            self._drop(block_id)
            return None, None
        self._register(block_id, h, token_ids, parent)
        return block_id, source

    def _acquire(self, block_id: int) -> None:
        if self._ref[block_id] == 0:
            del self._evictable[block_id]
        self._ref[block_id] += 1

    def _drop(self, block_id: int) -> None:
        """One reference less; an unreferenced block becomes evictable (registered) or free."""
        self._ref[block_id] -= 1
        assert self._ref[block_id] >= 0, f"block {block_id} freed twice"
        if self._ref[block_id] == 0:
            if self._hash[block_id] is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def _allocate_one(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently used
            self._evict(block_id)
        self._ref[block_id] = 1
        return block_id

    def _evict(self, block_id: int) -> None:
        """Unregisters a block and, before it, every cached block that extends it: those in
        use stay with their sequences, unregistered; unused ones become free."""
        order, stack = [], [self._hash[block_id]]
        while stack:  # every descendant after its parent; not recursive: chains are long
            h = stack.pop()
            order.append(h)
            stack.extend(self._children.pop(h, ()))
        for h in reversed(order):  # leaves first, so the index never shows a gap
            victim = self._cached[h]
            self._offload_or_drop(victim, h)
            del self._cached[h]
            parent = self._parent[victim]
            if parent != ROOT_HASH and parent in self._children:
                self._children[parent].discard(h)
                if not self._children[parent]:
                    del self._children[parent]
            self._hash[victim] = self._tokens[victim] = self._parent[victim] = None
            if victim != block_id and self._ref[victim] == 0:
                del self._evictable[victim]
                self._free.append(victim)

    def _offload_or_drop(self, block_id: int, h: int) -> None:
        """An evicted block (its parent still cached here) goes to the host tier if there is
        one, else its contents are gone; the events say which."""
        if self.host_tier is None:
            self._events.append(("removed", h, "device"))
            return
        token_ids, parent = self._tokens[block_id], self._parent[block_id]
        self._events += self.host_tier.offload(block_id, h, token_ids, parent)

    def check_invariants(self) -> None:
        """Asserts the state partition above (used by tests)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        for block_id, ref in enumerate(self._ref):
            assert ref >= 0
            in_pool = block_id in free or block_id in evictable
            assert in_pool == (ref == 0), f"block {block_id}: ref {ref}, in free pool {in_pool}"
            assert (block_id in evictable) <= (self._hash[block_id] is not None)
        for h, block_id in self._cached.items():
            assert self._hash[block_id] == h
            parent = self._parent[block_id]
            assert parent == ROOT_HASH or h in self._children.get(parent, ()), f"{h}: a gap"
        for parent, children in self._children.items():
            assert parent in self._cached and children <= self._cached.keys()
