"""What `LLMEngine.stats()` reports, gathered from the engine's parts: the block pool, the
queues, prefix hits by tier (device, host, disk, peer), peer pulls, tokens and steps, and the
speculation's and the executor's own figures (docs/structures.md lists every key)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.engine.host_tier import host_tier_stats
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculation.speculative_step import Speculation, speculation_stats


def engine_stats(
    engine: Any, seqs: Iterable[Sequence], steps: int, speculation: Speculation | None
) -> dict[str, int | float]:
    """`engine`: the LLMEngine whose parts are read (not imported: it imports this module);
    `seqs`: the engine's requests (choice 0's sequences); `steps`: the steps it ran."""
    bm, sched, peers = engine.block_manager, engine.scheduler, engine.peer_prefixes
    by_status = {s: 0 for s in SequenceStatus}
    for seq in seqs:
        by_status[seq.status] += 1
    return {
        "num_blocks": bm.num_blocks,
        "num_free_blocks": bm.num_free_blocks,
        "num_used_blocks": bm.num_used_blocks,
        "num_cached_blocks": bm.num_cached_blocks,
        "num_evictable_blocks": bm.num_evictable_blocks,
        "num_waiting": len(sched.waiting),
        "num_running": len(sched.running),
        "num_reserved": by_status[SequenceStatus.RESERVED],
        "num_held": by_status[SequenceStatus.HELD],
        "waiting_prompt_tokens": bm.queued_prompt_tokens(sched.waiting),
        "prefix_hit_tokens": sched.prefix_hit_tokens,
        "prefix_query_tokens": sched.prefix_query_tokens,
        "prefix_host_hit_tokens": sched.prefix_host_hit_tokens,
        "prefix_disk_hit_tokens": sched.prefix_disk_hit_tokens,
        "prefix_peer_hit_tokens": peers.peer_hit_tokens,
        "peer_pulls_started": peers.pulls_started,
        "peer_pulls_committed": peers.pulls_committed,
        "peer_pulls_fallen_back": peers.pulls_fallen_back,
        **host_tier_stats(engine.host_tier),
        "num_preemptions": sched.num_preemptions,
        "prefill_tokens_computed": engine.step_outputs.prefill_tokens_computed,
        "decode_tokens": engine.step_outputs.decode_tokens,
        "steps": steps,
        "overlapped_steps": engine.overlapped_steps.launched_steps,
        **speculation_stats(speculation),
        **engine.executor.stats(),
    }
