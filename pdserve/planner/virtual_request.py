"""VirtualRequest: one request's life in the simulated cluster, as router/request_flow.py runs
it: the router's `Routing.choose` picks the route; a local prefill is `add_request` on the
decode worker (with --peer-pull, after pulling a peer's prefix: virtual_pull.py); a
disaggregated one is `reserve` on the decode worker, a prefill-only run on the prefill worker, the push of the blocks the decode worker lacks (`Deployment.push_seconds`), then
`commit` on the decode worker and, once committed, `release` on the prefill worker (each of
these calls waits for its worker's step in progress). As prefill_service/worker.py answers the
router twice, the first token reaches the client when the prefill step sampled it; the second
answer comes after the release, and only then does the router stream the decode worker's
tokens: those made meanwhile follow at once, the others at the end of the decode steps that
made them. Workers at
capacity (the policy finds every option full, or a reservation without room) make the request
wait for room with RequestFlow's backoff, up to `room_wait_s`, then it is refused.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from pdserve.core.messages import PrefillResult
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import RequestOutput, Reservation
from pdserve.planner.virtual_pull import pull_and_prefill
from pdserve.planner.workload import ProbeRequest
from pdserve.workloads.metrics import RequestRecord
from router.types import AtCapacity, NoWorkerAvailable, Overloaded, Route

if TYPE_CHECKING:
    from pdserve.planner.cluster import VirtualCluster
    from pdserve.planner.virtual_worker import VirtualWorker


class RequestObserver(Protocol):
    def first_token(self, request: VirtualRequest) -> None: ...

    def ended(self, request: VirtualRequest) -> None: ...


class VirtualRequest:
    def __init__(
        self, cluster: VirtualCluster, probe: ProbeRequest, observer: RequestObserver
    ) -> None:
        self.cluster = cluster
        self.routing = cluster.router_of(probe.index)  # every attempt's and answer's router
        self.probe = probe
        self.observer = observer
        self.record = RequestRecord(
            index=probe.index,
            request_id=f"r{probe.index}",
            prompt_len=len(probe.prompt),
            max_tokens=probe.output_len,
            tag=probe.tag,
        )
        self.params = SamplingParams(max_tokens=probe.output_len, ignore_eos=True)
        self.tokens: list[int] = []  # kept when the cluster keeps tokens (tests)
        self.route: Route | None = None
        # The prefill worker's answer (queue, prefill and transfer times) once disaggregated:
        # what the live router gets back, for comparing TTFT parts (plan_validation).
        self.prefill_result: PrefillResult | None = None
        self._held: list[RequestOutput] | None = None  # see _pushed
        self._attempts = 0
        self._waiting_since: float | None = None
        self._occupied: AbstractContextManager | None = None

    @property
    def ended(self) -> bool:
        return self.record.end_time is not None

    def start(self) -> None:
        self.record.send_time = self.cluster.loop.now
        self._attempt()

    # ---- routing ----------------------------------------------------------------------------
    def _attempt(self) -> None:
        self._attempts += 1
        prompt = self.probe.prompt
        try:
            self.route = route = self.routing.choose(prompt, self.probe.output_len, set())
        except AtCapacity as exc:
            self._wait_for_room(str(exc))
            return
        except (Overloaded, NoWorkerAvailable) as exc:
            self._end(ok=False, error=f"{type(exc).__name__}: {exc}")
            return
        workers = [w for w in (route.decode_worker, route.prefill_worker) if w]
        self._occupied = self.cluster.pool.occupied(workers)
        self._occupied.__enter__()
        self.work_id = f"{self.record.request_id}#{self._attempts}"
        decode = self.cluster.workers[route.decode_worker]
        if route.prefill_worker is None:
            self.cluster.listen(decode, self.work_id, self._on_decode_output)
            if route.peer_pull is not None:
                pull_and_prefill(
                    self.cluster, self.work_id, prompt, self.params, decode.worker_id,
                    route.peer_pull,
                )  # fmt: skip
            else:
                decode.call(lambda: decode.engine.add_request(self.work_id, prompt, self.params))
        else:
            decode.call(
                lambda: decode.engine.reserve(self.work_id, prompt, self.params), self._reserved
            )

    def _wait_for_room(self, reason: str) -> None:
        now = self.cluster.loop.now
        if self._waiting_since is None:
            self._waiting_since = now
        waited = now - self._waiting_since
        timing = self.cluster.timing
        if waited >= timing.room_wait_s:
            self._end(ok=False, error=f"RESOURCE_EXHAUSTED: {reason}")
            return
        tries = self._attempts - 1
        pause = timing.room_backoff_s[min(tries, len(timing.room_backoff_s) - 1)]
        self.cluster.loop.after(pause, self._attempt)

    def _leave_workers(self) -> None:
        if self._occupied is not None:
            self._occupied.__exit__(None, None, None)
            self._occupied = None

    # ---- disaggregated: reserve, prefill, push, commit ---------------------------------------
    def _reserved(self, reservation: Reservation | None) -> None:
        if reservation is None:
            self._leave_workers()
            self._wait_for_room(f"decode worker {self.route.decode_worker} has no free KV blocks")
            return
        self.reservation = reservation
        prefill = self.cluster.workers[self.route.prefill_worker]
        self.cluster.listen(prefill, self.work_id, self._on_prefill_output)
        self._prefill_sent = self.cluster.loop.now

        def add() -> None:
            prefill.engine.add_request(
                self.work_id, self.probe.prompt, self.params, prefill_only=True
            )
            prefill.track_queue(self.work_id)

        prefill.call(add)

    def _on_prefill_output(self, worker: VirtualWorker, out: RequestOutput) -> None:
        loop, rid = self.cluster.loop, self.work_id
        queue_s = worker.queue_waits.pop(rid, 0.0)
        result = PrefillResult(
            request_id=rid,
            worker_id=worker.worker_id,
            first_token_id=out.new_token_ids[0],
            first_logprob=None,
            finished=out.finish_reason != "prefill",
            finish_reason=None if out.finish_reason == "prefill" else out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            queue_s=queue_s,
            prefill_s=loop.now - self._prefill_sent - queue_s,
        )
        self.prefill_result = result
        decode = self.cluster.workers[self.route.decode_worker]
        if result.finished:  # the first token ended it: the reservation is not needed
            decode.call(lambda: decode.engine.abort(rid))
            self.routing.on_prefill_done(self.route, result)
            self._token(out.new_token_ids)
            self._end(ok=True)
            return
        self.routing.on_prompt_computed(self.route)
        self._token(out.new_token_ids)  # the first answer: streamed before the push
        blocks = [out.block_ids[i] for i in self.reservation.missing_block_indices]
        num_bytes = len(blocks) * worker.engine.bytes_per_block
        seconds = self.cluster.deployment.push_seconds(num_bytes)
        loop.after(seconds, lambda: self._pushed(worker, result, num_bytes, seconds))

    def _pushed(
        self, prefill: VirtualWorker, result: PrefillResult, num_bytes: int, seconds: float
    ) -> None:
        rid = self.work_id
        pushed_from = self.cluster.loop.now - seconds
        result.transfer_bytes = num_bytes
        decode = self.cluster.workers[self.route.decode_worker]
        self.cluster.listen(decode, rid, self._on_decode_output)
        self._held = []  # decode outputs made before the router streams the decode worker

        def committed(_: None) -> None:
            # The push returns once the commit did (grpc_sender.send): its seconds, which the
            # worker reports and the router's cost model learns, hold the commit's wait for
            # the decode worker's step in progress.
            result.transfer_s = self.cluster.loop.now - pushed_from
            prefill.record_transfer(num_bytes, result.transfer_s)
            # The prefill worker then releases its blocks and only then answers the router a
            # second time (prefill_service/worker.py), after its step in progress.
            prefill.call(lambda: prefill.engine.release(rid), released)

        def released(_: None) -> None:
            self.routing.on_prefill_done(self.route, result)
            held, self._held = self._held, None
            for out in held:  # the router now streams the decode worker: these come at once
                self._on_decode_output(decode, out)

        decode.call(lambda: decode.engine.commit(rid, result.first_token_id, None), committed)

    # ---- tokens -----------------------------------------------------------------------------
    def _on_decode_output(self, worker: VirtualWorker, out: RequestOutput) -> None:
        if self._held is not None:
            self._held.append(out)
            return
        if out.new_token_ids:
            if not self.record.chunk_times and self.route.prefill_worker is None:
                # A local prefill's first answer: as the live router does (RequestFlow's
                # on_prefill_done), the prompt stops counting in the worker's queue now, not
                # at the next poll, up to 0.25 s and two 4096-token prefills away.
                self.routing.on_prompt_computed(self.route)
            self._token(out.new_token_ids)
        if out.finished:
            self._end(ok=True)

    def _token(self, token_ids: list[int]) -> None:
        # Once per simulated token: each attribute looked up once.
        record, cluster = self.record, self.cluster
        times = record.chunk_times
        times.append(cluster.loop.now)
        record.chunk_tokens.append(len(token_ids))
        if cluster.keep_tokens:
            self.tokens += token_ids
        if len(times) == 1:
            self.observer.first_token(self)

    def _end(self, *, ok: bool, error: str = "") -> None:
        self._leave_workers()
        record = self.record
        record.ok, record.error = ok, error
        record.error_code = None if ok else error.split(":")[0]
        record.end_time = self.cluster.loop.now
        self.observer.ended(self)
