"""Fills the prefix index for `bench control-plane`, by the workers' events or in bulk.

`fill_index` goes through the workers' real publishing path step by step: each synthetic
worker is a sim engine (pdserve's scheduler, block manager and prefix cache;
`pdserve/sim` in place of the model) that computes the prompts it should cache; the KV events
its block manager emits go to a `PrefixIndexPublisher` registered under the worker's id, one
`publish` per engine step (the call the worker's `IndexFeeder` thread makes). Engines run one
after another in a few fill processes and are dropped once their worker's entries are in Redis:
the router needs a live heartbeat per worker (`heartbeat_ttl_s` outlasts the bench), not the
engines. So 256 workers cost the memory of one engine per fill process. A 1M-block index took
430 s that way on a loaded 2-core VM.

`bulk_fill_index` writes the state those events end in, without the engines: each worker's
block set is the union of the chained hashes of the prompts it caches (what its block manager
stores for them, nothing evicted), written by the worker's real `PrefixIndexPublisher` as one
resync (the transaction a worker uses after an outage: its block entries, its block set, its
heartbeat and a `reset` event). The index, and the mirror built from it, are the same; only the
stream holds one reset per worker instead of the updates.
"""

from __future__ import annotations

import json
import multiprocessing
import resource
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.control_plane.control_plane_workload import IndexPlan, PlanSettings

MODEL_NAME = "control-plane"


@dataclass
class WorkerFill:
    """What one worker's engine emitted and published."""

    worker: int
    stored_blocks: int
    removed_blocks: int
    publishes: int  # publish() calls that reached Redis
    failed_publishes: int
    engine_steps: int
    num_blocks: int  # its KV pool
    bytes_per_block: int


def write_model(directory: Path, vocab_size: int) -> Path:
    """A Llama-3.1-8B-shaped config-only model with a small vocabulary: the vocabulary only
    sizes the LM head in the timing model, and a small tokenizer loads in milliseconds."""
    from pdserve.models.tokenizer_builder import write_tokenizer
    from pdserve.sim.shapes import shape_config

    config = shape_config("llama-3.1-8b") | {"vocab_size": vocab_size}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    write_tokenizer(directory, vocab_size)
    return directory


def fill_worker(
    plan: IndexPlan, worker: int, redis_url: str, model_dir: str, heartbeat_ttl_s: float
) -> WorkerFill:
    """Runs `worker`'s engine over the prompts it caches, publishing its KV events."""
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig, SimConfig
    from pdserve.prefix_index.publisher import PrefixIndexPublisher

    s = plan.settings
    held = plan.held_by(worker)
    # Room for everything it caches plus the blocks of the prompts in flight: nothing evicted.
    prompt_blocks = s.prompt_tokens // s.block_size
    num_blocks = plan.held_blocks(worker) + 4 * prompt_blocks
    batched = 2 * s.prompt_tokens
    config = EngineConfig(
        model=model_dir,
        kind="sim",
        dtype="bfloat16",
        block_size=s.block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=batched,
        max_model_len=s.prompt_tokens + 16,
        # The fill measures nothing in simulated time: steps take no modelled wall time.
        sim=SimConfig(time_scale=1e-9),
    )
    publisher = PrefixIndexPublisher(
        redis_url, plan.worker_id(worker), MODEL_NAME, s.block_size, heartbeat_ttl_s=heartbeat_ttl_s
    )
    publisher.register()  # a new epoch, as a starting worker takes: the time in ns
    pending: list = []
    engine = LLMEngine(config, kv_event_sink=pending.extend, emit_text=False)
    fill = WorkerFill(worker, 0, 0, 0, 0, 0, num_blocks, engine.bytes_per_block)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for conv in held:
        engine.add_request(f"c{conv.index}", plan.conversation_tokens(conv), params)
    while engine.has_unfinished():
        engine.step()
        fill.engine_steps += 1
        if pending:
            for event in pending:
                n = len(event.block_hashes)
                if event.kind == "stored":
                    fill.stored_blocks += n
                else:
                    fill.removed_blocks += n
            ok = publisher.publish(pending)
            fill.publishes += ok
            fill.failed_publishes += not ok
            pending.clear()
    publisher.close()  # no unregister: the entries stay live until the heartbeat expires
    return fill


def bulk_fill_index(
    plan: IndexPlan, redis_url: str, *, heartbeat_ttl_s: float = 3600.0
) -> list[WorkerFill]:
    """Every worker's entries, one resync each; each conversation's prompt is hashed once."""
    from pdserve.core.block_hash import prompt_block_hashes
    from pdserve.prefix_index.publisher import PrefixIndexPublisher

    s = plan.settings
    held: list[set[int]] = [set() for _ in range(s.workers)]
    for conv in plan.conversations:
        hashes = prompt_block_hashes(plan.conversation_tokens(conv), s.block_size)
        for w in conv.holders:
            held[w].update(hashes)
    fills = []
    for w, hashes in enumerate(held):
        publisher = PrefixIndexPublisher(
            redis_url, plan.worker_id(w), MODEL_NAME, s.block_size, heartbeat_ttl_s=heartbeat_ttl_s
        )
        ok = publisher.register() and publisher.resync(hashes)
        publisher.close()  # no unregister: the entries stay live until the heartbeat expires
        # No engine ran: no steps, and a pool of exactly what it holds (nothing reads its size).
        fills.append(WorkerFill(w, len(hashes), 0, int(ok), int(not ok), 0, len(hashes), 0))
    return fills


def _fill_range(args: tuple) -> tuple[list[WorkerFill], int]:
    settings, workers, redis_url, model_dir, ttl = args
    plan = IndexPlan.build(settings)
    fills = [fill_worker(plan, w, redis_url, model_dir, ttl) for w in workers]
    return fills, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fill_index(
    settings: PlanSettings, redis_url: str, *, processes: int = 2, heartbeat_ttl_s: float = 3600.0,
    model_dir: str | None = None,
) -> tuple[list[WorkerFill], int]:  # fmt: skip
    """Fills every worker's entries; returns the fills and the largest fill process's peak RSS."""
    with tempfile.TemporaryDirectory(prefix="pdserve-cp-model-") as tmp:
        model = model_dir or str(write_model(Path(tmp), settings.vocab_size))
        chunks = [list(range(i, settings.workers, processes)) for i in range(processes)]
        tasks = [(settings, c, redis_url, model, heartbeat_ttl_s) for c in chunks if c]
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(len(tasks), mp_context=context) as pool:
            results = list(pool.map(_fill_range, tasks))
    fills = sorted((f for chunk, _ in results for f in chunk), key=lambda f: f.worker)
    return fills, max(rss for _, rss in results)
