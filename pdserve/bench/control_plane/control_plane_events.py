"""The prefix index's publishing load per worker, for `bench control-plane`.

One prefill worker and one decode worker, each a sim engine whose steps last what a linear
timing profile says (so it runs at the stated token rate in wall time) and whose KV events go
through the worker's real `IndexFeeder` (queue, feeder thread, batched `publish`, heartbeats)
to a private redis-server that nothing else uses. Their KV pools are small enough to be full
within the warm-up, so the window sees evictions ("removed") as a loaded worker does.
Measured over the window: KV events and blocks per second from the engine, and Redis
commands and bytes received per second (INFO stats deltas), per worker.

  prefill worker  prompts of `prompt_tokens` whose first `system_tokens` are a cached system
                  prompt, computed at `prefill_tok_s` (prefill_only, released when done: the
                  prefill worker's life of a request);
  decode worker   `decode_batch` running sequences at `decode_tok_s_per_seq` each; a finished
                  one is replaced by a reserved-and-committed prompt (the KV handoff's engine
                  calls, which cache the prompt's blocks as a push does).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EventLoad:
    block_size: int = 16
    prompt_tokens: int = 4096
    system_tokens: int = 1024
    system_prompts: int = 8
    decode_batch: int = 64
    decode_tok_s_per_seq: float = 40.0
    output_tokens: int = 256
    prefill_tok_s: float = 10_000.0
    seconds: float = 10.0
    warmup_s: float = 3.0
    vocab_size: int = 4096


class _Counting:
    """The engine's KV event sink: counts, then hands the batch to the feeder."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.events = self.blocks = 0

    def __call__(self, events: list) -> None:
        self.events += len(events)
        self.blocks += sum(len(e.block_hashes) for e in events)
        self.forward(events)


def measure_publishing(load: EventLoad) -> dict[str, Any]:
    """{"prefill": figures, "decode": figures}: per-second rates over the window."""
    from pdserve.bench.control_plane.control_plane_fill import write_model

    with tempfile.TemporaryDirectory(prefix="pdserve-cp-events-") as tmp:
        model = write_model(Path(tmp) / "model", load.vocab_size)
        return {role: _measure_role(role, load, model, Path(tmp)) for role in ("prefill", "decode")}


def _measure_role(role: str, load: EventLoad, model: Path, tmp: Path) -> dict[str, Any]:
    import redis

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig, SimConfig
    from pdserve.prefix_index.feeder import IndexFeeder
    from pdserve.prefix_index.redis_server import RedisServer

    profile = tmp / f"{role}.json"
    step = {"step_s": 0.0, "prefill_token_s": 1 / load.prefill_tok_s, "decode_seq_s": 0.0,
            "context_token_s": 0.0}  # fmt: skip
    if role == "decode":
        step = dict.fromkeys(step, 0.0) | {"step_s": 1 / load.decode_tok_s_per_seq}
    profile.write_text(json.dumps({"kind": "linear", **step}), encoding="utf-8")
    prompt_blocks = load.prompt_tokens // load.block_size
    per_seq = prompt_blocks + load.output_tokens // load.block_size + 2
    # Full within the warm-up: the prefill worker caches ~10 prompts, the decode worker its
    # batch plus a quarter more.
    num_blocks = 10 * prompt_blocks if role == "prefill" else load.decode_batch * per_seq * 5 // 4
    config = EngineConfig(
        model=str(model),
        kind="sim",
        dtype="bfloat16",
        block_size=load.block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=max(load.decode_batch, 8),
        max_num_batched_tokens=max(load.prompt_tokens, load.decode_batch),
        max_model_len=load.prompt_tokens + load.output_tokens + load.block_size,
        sim=SimConfig(profile=str(profile), time_scale=1.0),
    )
    with RedisServer() as server:
        feeder = IndexFeeder(server.url, f"{role}-0", 1, "control-plane", load.block_size, 10.0)
        sink = _Counting(feeder.enqueue)
        engine = LLMEngine(config, kv_event_sink=sink, emit_text=False)
        driver = _Driver(role, engine, load)
        client = redis.Redis.from_url(server.url)
        try:
            driver.run_for(min(load.warmup_s, load.seconds))
            before = _counters(client), sink.events, sink.blocks, driver.tokens
            driver.run_for(load.seconds)
            time.sleep(0.1)  # the feeder's last batch
            after = _counters(client), sink.events, sink.blocks, driver.tokens
        finally:
            feeder.stop()
            client.close()
    seconds = load.seconds
    (c0, e0, b0, t0), (c1, e1, b1, t1) = before, after
    return {
        "tokens_per_s": (t1 - t0) / seconds,
        "events_per_s": (e1 - e0) / seconds,
        "blocks_per_s": (b1 - b0) / seconds,
        # Minus the INFO call that read the counters.
        "commands_per_s": (c1[0] - c0[0] - 1) / seconds,
        "bytes_in_per_s": (c1[1] - c0[1]) / seconds,
        "kv_blocks": num_blocks,
    }


class _Driver:
    """Keeps one engine busy the way its role is: a full prefill queue, or a full decode batch."""

    def __init__(self, role: str, engine, load: EventLoad) -> None:
        from pdserve.core.sampling_params import SamplingParams

        self.role, self.engine, self.load = role, engine, load
        self.rng = random.Random(f"events:{role}")
        self.params = SamplingParams(
            max_tokens=1 if role == "prefill" else load.output_tokens, ignore_eos=True
        )
        self.active = 0
        self.tokens = 0  # prompt tokens computed (prefill) or tokens decoded (decode)
        self._ids = iter(range(1 << 62))

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._top_up()
            for out in self.engine.step():
                if self.role == "decode":
                    self.tokens += len(out.new_token_ids)
                if out.finished:
                    self.active -= 1
                    if self.role == "prefill":
                        self.engine.release(out.request_id)
            if self.role == "prefill":
                self.tokens = self.engine.stats()["prefill_tokens_computed"]

    def _top_up(self) -> None:
        want = 2 if self.role == "prefill" else self.load.decode_batch
        while self.active < want:
            rid = f"r{next(self._ids)}"
            prompt = self._prompt()
            if self.role == "prefill":
                self.engine.add_request(rid, prompt, self.params, prefill_only=True)
            else:
                if self.engine.reserve(rid, prompt, self.params) is None:
                    return
                self.engine.commit(rid, prompt[-1], None)
            self.active += 1

    def _prompt(self) -> list[int]:
        load, rng = self.load, self.rng
        system = random.Random(f"system:{rng.randrange(load.system_prompts)}")
        span = load.vocab_size - 3
        shared = [3 + system.randrange(span) for _ in range(load.system_tokens)]
        own = [3 + rng.randrange(span) for _ in range(load.prompt_tokens - load.system_tokens)]
        return shared + own


def _counters(client) -> tuple[int, int]:
    info = client.info("stats")
    return int(info["total_commands_processed"]), int(info["total_net_input_bytes"])
