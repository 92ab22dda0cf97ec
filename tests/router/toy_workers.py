"""In-process workers for RequestFlow tests: real classes implementing router.types.WorkerHandle.

A tiny deterministic "model" stands in for the engine and behaves like it where the router can
tell: a greedy token depends on the token sequence only (here, on its length: `script[len]`), a
seeded sampled token on (seed, seed_offset + n) only, text and stop strings come from the
worker's own IncrementalDetokenizer over its prompt (as in pdserve/engine/engine.py), KV blocks
are reserved, committed and freed. Faults are switched on per worker: die or freeze after a
number of tokens, refuse reservations. Nothing here imports Ray, gRPC or Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.core.messages import (
    KVReservation,
    PrefillResult,
    TokenBatch,
    WorkerStats,
    WorkRequest,
)
from pdserve.core.sampling_params import SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

BLOCK_SIZE = 4


class WorkerDied(RuntimeError):
    """What a dead actor's call raises (Ray: RayActorError)."""


class ToyModel:
    """Greedy: the token at sequence position L is `script[L % len(script)]`. Seeded sampling:
    a token derived from (seed, n) alone, n counted from `seed_offset`."""

    def __init__(self, script: list[int], vocab_size: int) -> None:
        self.script = script
        self.vocab_size = vocab_size

    def next_token(self, ids: list[int], params: SamplingParams, n: int) -> int:
        if params.greedy or params.seed is None:
            return self.script[len(ids) % len(self.script)]
        index = params.seed_offset + n
        digest = hashlib.blake2b(struct.pack("<QQ", params.seed, index), digest_size=4).digest()
        return 3 + int.from_bytes(digest, "little") % (self.vocab_size - 3)  # no special tokens


@dataclass
class _Request:
    """One request's sequence on a toy worker, produced like the engine's
    `StepOutputs.append_tokens`."""

    ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    blocks: int
    produced: int = 0
    finish_reason: str | None = None
    committed: asyncio.Event = field(default_factory=asyncio.Event)


class ToyWorker:
    """The part prefill and decode workers share: the model, the block pool, stats, abort."""

    role = ""

    def __init__(
        self, worker_id: str, model: ToyModel, tokenizer: Tokenizer, num_blocks: int = 1024
    ) -> None:
        self.worker_id = worker_id
        self.model = model
        self.tokenizer = tokenizer
        self.num_blocks = num_blocks
        self.requests: dict[str, _Request] = {}
        self.aborted: list[str] = []  # every abort call, in order
        self.tokens_produced = 0
        self.step_s = 0.0  # time one token takes
        self.round_trip_s = 0.0  # a heartbeat's or stats poll's network round trip
        self.die_after_tokens: int | None = None  # then every call raises WorkerDied
        self.freeze_after_tokens: int | None = None  # then every call hangs
        self.freeze_after_reserving = False  # decode: freezes once a reservation is made
        self._thawed = asyncio.Event()

    @property
    def used_blocks(self) -> int:
        return sum(r.blocks for r in self.requests.values())

    @property
    def dead(self) -> bool:
        return self.die_after_tokens is not None and self.tokens_produced >= self.die_after_tokens

    async def _alive(self) -> None:
        """Every call passes here: raises if the worker died, waits while it is frozen."""
        if self.dead:
            raise WorkerDied(f"{self.worker_id} died")
        frozen = self.freeze_after_tokens
        if frozen is not None and self.tokens_produced >= frozen:
            await self._thawed.wait()

    def thaw(self) -> None:
        self.freeze_after_tokens = None
        self._thawed.set()

    async def ready(self) -> dict:
        return {}

    async def heartbeat(self) -> float:
        await self._alive()
        await asyncio.sleep(self.round_trip_s)
        return 0.0

    async def stats(self) -> WorkerStats:
        await self._alive()
        await asyncio.sleep(self.round_trip_s)
        return WorkerStats(
            self.worker_id,
            self.role,
            epoch=1,
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks - self.used_blocks,
            num_running=len(self.requests),
            block_size=BLOCK_SIZE,
        )

    async def abort(self, request_id: str) -> None:
        # Like a Ray actor call: once sent it runs, even if the caller stops waiting (a frozen
        # worker runs it when it thaws).
        await asyncio.shield(self._abort(request_id))

    async def _abort(self, request_id: str) -> None:
        await self._alive()
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def _admit(self, work: WorkRequest) -> _Request | None:
        blocks = math.ceil(len(work.prompt_token_ids) / BLOCK_SIZE)
        if blocks > self.num_blocks - self.used_blocks:
            return None
        params = work.sampling
        request = _Request(
            ids=list(work.prompt_token_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, work.prompt_token_ids, params.stop),
            blocks=blocks,
        )
        self.requests[work.request_id] = request
        return request

    async def _step(self, request: _Request) -> tuple[int, str]:
        """One token (and its text delta) of the request, like the engine's
        `StepOutputs.append_tokens`."""
        await self._alive()
        await asyncio.sleep(self.step_s)
        token = self.model.next_token(request.ids, request.params, request.produced)
        request.ids.append(token)
        request.produced += 1
        self.tokens_produced += 1
        params = request.params
        stop_token = token in params.stop_token_ids or (
            not params.ignore_eos and token in self.tokenizer.eos_token_ids
        )
        text = "" if stop_token else request.detokenizer.add([token])
        if stop_token or request.detokenizer.stopped is not None:
            request.finish_reason = "stop"
        elif request.produced >= params.max_tokens:
            request.finish_reason = "length"
        if request.finish_reason:
            text += request.detokenizer.flush()
        return token, text


class ToyDecodeWorker(ToyWorker):
    role = "decode"

    def __init__(self, *args, batch_tokens: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch_tokens = batch_tokens  # tokens per streamed batch (the engine drains steps)
        self.refuse_reservations = False
        self.reservations = 0

    async def reserve(self, work: WorkRequest) -> KVReservation | None:
        await self._alive()
        self.reservations += 1
        request = None if self.refuse_reservations else self._admit(work)
        if request is None:
            return None
        if self.freeze_after_reserving:
            self.freeze_after_tokens = self.tokens_produced
        return KVReservation(
            decode_worker=self.worker_id,
            transfer_id=work.request_id,
            endpoint=self.worker_id,
            missing_block_indices=list(range(request.blocks)),
            num_cached_tokens=0,
            deadline=0.0,
        )

    def commit(self, transfer_id: str, first_token: int) -> None:
        """The prefill worker's push arrived with the first token (KVSink.on_commit)."""
        request = self.requests[transfer_id]
        request.ids.append(first_token)
        request.detokenizer.add([first_token])  # the deltas that follow continue its text
        request.produced = 1
        request.committed.set()

    async def generate(self, work: WorkRequest) -> None:
        await self._alive()
        request = self._admit(work)
        if request is None:
            raise RuntimeError("toy workers do not queue local prefills")
        request.committed.set()

    async def stream(self, request_id: str):
        await self._alive()
        request = self.requests.get(request_id)
        if request is None:
            yield _aborted(request_id)
            return
        local = request.produced == 0
        await request.committed.wait()
        while request.finish_reason is None:
            ids, text = [], ""
            while len(ids) < self.batch_tokens and request.finish_reason is None:
                token, delta = await self._step(request)
                ids.append(token)
                text += delta
            if self.requests.get(request_id) is not request:  # aborted meanwhile
                yield _aborted(request_id)
                return
            if request.finish_reason is not None:  # its blocks go back to the pool
                self.requests.pop(request_id)
            batch = TokenBatch(
                request_id, ids, [], text, request.finish_reason is not None,
                request.finish_reason, num_prompt_tokens=len(request.ids) - request.produced,
            )  # fmt: skip
            if local:  # the prompt's full blocks were found cached, as on a retry
                batch.prefill_s, local = 0.0, False
                batch.num_cached_tokens = batch.num_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
            yield batch
            await asyncio.sleep(0)  # other requests' steps


def _aborted(request_id: str) -> TokenBatch:
    return TokenBatch(request_id, [], [], "", finished=True, finish_reason="abort")


class ToyPrefillWorker(ToyWorker):
    role = "prefill"

    def __init__(self, *args, decode_workers: dict[str, ToyDecodeWorker], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decode_workers = decode_workers  # the "network": endpoint -> decode worker

    async def prefill(
        self, work: WorkRequest, reservation: KVReservation
    ) -> AsyncIterator[PrefillResult]:
        """As PrefillWorker.prefill: the result at the first token, again once committed."""
        await self._alive()
        request = self._admit(work)
        if request is None:
            raise RuntimeError("toy workers do not queue prefills")
        try:
            token, _ = await self._step(request)
            result = PrefillResult(
                request_id=work.request_id, worker_id=self.worker_id, first_token_id=token,
                first_logprob=None, finished=request.finish_reason is not None,
                finish_reason=request.finish_reason, num_prompt_tokens=len(work.prompt_token_ids),
                num_cached_tokens=len(work.prompt_token_ids) // BLOCK_SIZE * BLOCK_SIZE,
                queue_s=0.0, prefill_s=0.0,
            )  # fmt: skip
            yield result
            if result.finished:
                return
            receiver = self.decode_workers[reservation.endpoint]
            await receiver._alive()  # the push is written into the decode worker's process
            receiver.commit(reservation.transfer_id, token)
        finally:
            self.requests.pop(work.request_id, None)  # released to its prefix cache
        yield result
