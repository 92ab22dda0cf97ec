"""The real router (WorkerPool, Routing, RoutingPolicy, RequestFlow) in-process over toy workers
(tests/router/toy_workers.py) instead of Ray actors, for the RequestFlow tests
(tests/router/test_request_flow*.py), and what they read of a request's batches."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.core.messages import TokenBatch
from pdserve.core.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from router.policy import RoutingPolicy
from router.request_flow import RequestFlow
from router.routing import Routing
from router.types import Progress
from router.worker_pool import WorkerPool
from tests.router.toy_workers import BLOCK_SIZE, ToyDecodeWorker, ToyModel, ToyPrefillWorker

VOCAB = 300
# A policy seed whose rotations both start at a multiple of 12 (router/policy.py draws where
# they start): with 1-4 workers of a role, the first attempt goes to decode-0 and prefill-0.
ROTATIONS_FROM_THE_FIRST = 24


PROMPT = [10, 11, 12, 13, 14, 15]  # 6 tokens: one full block of 4 and a partial one


LETTERS = [67, 68, 69, 70, 71, 72, 73, 74]  # "abcdefgh"


def script_after_prompt(outputs: list[int]) -> list[int]:
    """A greedy script whose continuation of PROMPT is `outputs`, then letters."""
    return [0] * len(PROMPT) + outputs + LETTERS * 8


@dataclass
class Cluster:
    pool: WorkerPool
    flow: RequestFlow
    prefill: dict[str, ToyPrefillWorker]
    decode: dict[str, ToyDecodeWorker]
    routing: Routing

    @property
    def workers(self) -> list:
        return [*self.prefill.values(), *self.decode.values()]

    async def generate(self, sampling: SamplingParams, request_id: str = "req"):
        """(batches, progress) of one request, consumed to the end."""
        progress = Progress(received=time.perf_counter(), prompt_tokens=len(PROMPT))
        batches = [b async for b in self.flow.run(request_id, PROMPT, sampling, {}, progress)]
        return batches, progress

    def leaked_blocks(self) -> dict[str, int]:
        """Blocks still held by live workers (a dead worker's died with it)."""
        return {w.worker_id: w.used_blocks for w in self.workers if not w.dead and w.used_blocks}


async def cluster(
    tokenizer: Tokenizer,
    script: list[int],
    *,
    prefill: int = 1,
    decode: int = 2,
    disaggregate: str = "always",
    num_blocks: int = 1024,
    progress_timeout_s: float = 5.0,
    heartbeat_timeout_s: float = 2.0,
    room_wait_s: float = 2.0,
    max_retries: int = 2,
    max_pending_requests: int = 256,
    on_prompt_computed=None,
    on_output_computed=None,
) -> Cluster:
    model = ToyModel(script, VOCAB)
    decoders = {
        f"decode-{i}": ToyDecodeWorker(f"decode-{i}", model, tokenizer, num_blocks=num_blocks)
        for i in range(decode)
    }
    prefillers = {
        f"prefill-{i}": ToyPrefillWorker(f"prefill-{i}", model, tokenizer, decode_workers=decoders)
        for i in range(prefill)
    }
    pool = WorkerPool(
        prefillers,
        decoders,
        poll_interval_s=0.02,
        call_timeout_s=1.0,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    await pool.start()
    # Round robin: the first attempt goes to decode-0, a retry to decode-1.
    config = RouterConfig(
        policy="round_robin",
        disaggregate=disaggregate,
        max_pending_requests=max_pending_requests,
    )
    routing = Routing(pool, RoutingPolicy(config, seed=ROTATIONS_FROM_THE_FIRST), BLOCK_SIZE)
    flow = RequestFlow(
        pool,
        routing.choose_async,
        tokenizer,
        max_retries=max_retries,
        progress_timeout_s=progress_timeout_s,
        room_wait_s=room_wait_s,
        on_prefill_done=routing.on_prefill_done,
        on_prompt_computed=on_prompt_computed or routing.on_prompt_computed,
        on_output_computed=on_output_computed or routing.on_output_computed,
        block_size=BLOCK_SIZE,
    )
    routing.count(flow.waiting_for_room)
    return Cluster(pool, flow, prefillers, decoders, routing)


def run(scenario, timeout_s: float = 20.0):
    """Runs an async scenario; a hang fails the test instead of stalling the suite."""

    async def bounded():
        return await asyncio.wait_for(scenario(), timeout_s)

    return asyncio.run(bounded())


def ids_of(batches: list[TokenBatch]) -> list[int]:
    return [t for b in batches for t in b.token_ids]


def text_of(batches: list[TokenBatch]) -> str:
    return "".join(b.text for b in batches)


def greedy(max_tokens: int, **params) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **params)
