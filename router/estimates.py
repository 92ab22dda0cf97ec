"""What each routing option would cost: TTFT, the TPOT it leads to, the harm to running decodes.

An option is (prefill worker P, decode worker D), or D alone prefilling locally (P = None).
Everything here is arithmetic on a snapshot of worker load plus the CostModel; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from router.cost_model import CostModel
from router.peer_pull import PULL_MARGIN, pull_seconds


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as the policy sees it: a stats snapshot plus the router's own fresher count
    of requests it sent there since that snapshot (so a burst does not herd onto one worker).
    Frozen: the router reuses a worker's WorkerLoad while its inputs stay the same, and
    `numbers` is computed once, here."""

    worker_id: str
    healthy: bool = True
    num_waiting: int = 0  # requests queued on the worker
    num_running: int = 0  # decode batch (decode workers)
    waiting_prompt_tokens: int = 0  # uncomputed prompt tokens queued
    num_blocks: int = 0  # KV pool size; 0 = unknown (no KV check)
    num_free_blocks: int = 0
    inflight: int = 0  # routed here after the snapshot (router-side)
    inflight_prompt_tokens: int = 0
    # KV blocks those requests will hold here (their prompt blocks not cached here and their
    # output's): a cold prefix routed here a moment ago is not in the snapshot's free blocks.
    inflight_blocks: int = 0
    # Of num_free_blocks, those holding cached prefixes (taken by evicting them), and the
    # worker's prefix hits and lookups in tokens (cumulative): how much of that cache its
    # requests reuse (`reused_blocks`).
    num_evictable_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    # The distinct blocks this router sent here within seconds (router/recent_prefixes.py):
    # the prefixes its requests are using, cached here whether or not a request holds them.
    recent_blocks: int = 0
    # A hybrid worker (`--hybrid`): it decodes as well as prefills, so a prefill it runs for
    # another worker stalls its own decodes, which the objective prices as a local prefill's.
    hybrid: bool = False
    # (num_running, queued_requests, queued_tokens, num_blocks, num_free_blocks, load, hybrid,
    # num_evictable_blocks, prefix_hit_tokens, prefix_query_tokens, inflight_blocks,
    # recent_blocks): the option matrix's row of this worker (router/option_matrix.py).
    numbers: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        numbers = (self.num_running, self.queued_requests, self.queued_tokens, self.num_blocks,
                   self.num_free_blocks, self.load, int(self.hybrid), self.num_evictable_blocks,
                   self.prefix_hit_tokens, self.prefix_query_tokens,
                   self.inflight_blocks, self.recent_blocks)  # fmt: skip
        object.__setattr__(self, "numbers", numbers)  # frozen: set once, as __init__ does

    @classmethod
    def from_stats(cls, stats, *, healthy: bool = True, inflight: int = 0,
                   inflight_prompt_tokens: int = 0, inflight_blocks: int = 0,
                   recent_blocks: int = 0) -> WorkerLoad:  # fmt: skip
        """From a pdserve.core.messages.WorkerStats (reservations count as waiting requests)."""
        return cls(
            worker_id=stats.worker_id,
            healthy=healthy,
            num_waiting=stats.num_waiting + stats.num_reserved,
            num_running=stats.num_running,
            waiting_prompt_tokens=stats.waiting_prompt_tokens,
            num_blocks=stats.num_blocks,
            num_free_blocks=stats.num_free_blocks,
            inflight=inflight,
            inflight_prompt_tokens=inflight_prompt_tokens,
            inflight_blocks=inflight_blocks,
            hybrid=stats.role == "hybrid",
            num_evictable_blocks=stats.num_evictable_blocks,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            prefix_query_tokens=stats.prefix_query_tokens,
            recent_blocks=recent_blocks,
        )

    @property
    def queued_requests(self) -> int:
        return self.num_waiting + self.inflight

    @property
    def queued_tokens(self) -> int:
        return self.waiting_prompt_tokens + self.inflight_prompt_tokens

    @property
    def load(self) -> int:
        """Requests on the worker, the tie-breaker between equally good options."""
        return self.num_waiting + self.num_running + self.inflight

    @property
    def reused_blocks(self) -> float:
        """The cached blocks no request holds that requests are about to reuse: counted free,
        yet a tenant's prefix cached there is taken by its next turn, so filling them evicts
        what is about to be needed (`objective`'s KV pressure). As many as the worker's prefix
        hit rate says, or as the blocks routed here within seconds beyond those requests hold
        (held or in flight), if more: a worker that just took three tenants' cold first turns
        has a low hit rate, and their next turns reuse all three prefixes."""
        by_rate = self.num_evictable_blocks * (
            self.prefix_hit_tokens / max(1, self.prefix_query_tokens)
        )
        unheld = (
            self.recent_blocks - (self.num_blocks - self.num_free_blocks) - self.inflight_blocks
        )
        return max(by_rate, min(self.num_evictable_blocks, max(0, unheld)))


@dataclass(frozen=True)
class RoutingRequest:
    prompt_tokens: int
    max_tokens: int
    block_size: int
    bytes_per_block: int = 0  # KV bytes of one block over all layers; 0 = transfers are free

    @property
    def full_blocks(self) -> int:
        return self.prompt_tokens // self.block_size

    @property
    def total_blocks(self) -> int:
        """Blocks of the prompt's block table, the trailing partial block included."""
        return math.ceil(self.prompt_tokens / self.block_size)

    @property
    def output_blocks(self) -> int:
        """Blocks its output may take on the decode worker."""
        return math.ceil(self.max_tokens / self.block_size)

    def decode_blocks(self, decode_cached_blocks: int) -> int:
        """Blocks it will hold on a decode worker that has `decode_cached_blocks` of its prompt:
        the prompt's others and its output's (what KV pressure and the router's in-flight
        count of a worker's blocks charge)."""
        return self.total_blocks - decode_cached_blocks + self.output_blocks

    def uncached_tokens(self, cached_blocks: int) -> int:
        """Tokens to compute given a cached prefix; never 0 (the last prompt token is always
        run to sample the first output token)."""
        cached = min(cached_blocks, self.full_blocks) * self.block_size
        return max(1, self.prompt_tokens - cached)


@dataclass
class Weights:
    """How the objective trades the terms off (see `objective`)."""

    tpot: float = 1.0  # this request's own decode speed vs its TTFT
    # Prefill compute this option adds to the pool, which requests arriving later wait behind:
    # the throughput side of the trade. It is what makes a slightly slower worker that holds
    # the prefix beat an idle one that would compute the prefix all over again.
    compute: float = 1.0
    # Slowdown imposed on D's running requests, summed over them in TPOT-SLO units: small
    # beside this request's own terms, as a sum of slowdowns within the TPOT SLO costs no
    # request its SLO (a breach is the penalty's). At 1.0, `auto` 1P:7D sent code completion
    # to its prefill worker until its queue broke the TTFT SLO, 0.84x colocated's goodput;
    # at 0.25, 1.00x (docs/benchmarks/simulation.md, issue 49). At 0.125 `auto` kept 8B rag at
    # TPOT <= 20 ms within SLO (0.943 against 0.886 at 67.91 req/s), but the highest held
    # figure failed on 4 of 5 other cells tried: 70B mix loose, 70B rag at TPOT <= 20 and
    # 18 ms, 8B agentic at TTFT <= 200 ms (session 18).
    interference: float = 0.25
    slo_penalty: float = 4.0  # extra cost per unit beyond an SLO: misses are worse than slowness
    # The TTFT penalty starts this share of the SLO below it, the error of a predicted TTFT at
    # p90 (queues grow between polls): an option predicted just under the SLO is a likely
    # miss. With none, `auto` sent 70B rag prompts to a prefill queue predicted at 0.9-1.2 s
    # (they came out +0.09 s at the median, +0.28 s at p90; 38% missed 1 s) to spare decodes a
    # stall within their TPOT SLO, and trailed Dynamo's conditional rule, 10.3 against 11.0
    # req/s; at 0.3, 11.3 (docs/benchmarks/simulation.md, session 9). At 0.4 8B rag at TPOT
    # <= 20 ms kept 0.928 within SLO at 67.91 req/s (0.886 at 0.3), but the highest held
    # figure failed on 5 of 27 other cells re-probed (session 18).
    ttft_margin: float = 0.3
    kv_pressure: float = 2.0  # cost when D's KV occupancy after admission exceeds kv_soft_limit
    kv_soft_limit: float = 0.9
    # A one-off stall is spread over this many decode tokens of each stalled request, or over
    # this request's max_tokens when fewer (the best guess of its neighbours' lengths): a stall
    # hurts short requests' TPOT most.
    stall_amortize_tokens: int = 32
    # Requests a local prefill stalls beyond those D holds now: whoever the router sends to D
    # while the prefill runs (stats lag; arrivals keep coming). So stalling even an idle D has
    # a price, which a local prefill must beat against a remote one's transfer time.
    stall_newcomers: float = 1.0
    # A local prefill that breaks its batch's TPOT SLO is charged the overshoot once per
    # stalled request, up to this, in SLO units: the penalty of a TTFT predicted at 0.95 of its
    # SLO. So a breach loses to a remote prefill predicted to meet the TTFT SLO, and wins
    # against one predicted to miss it. Charged once, a 256-request batch's breach weighed
    # less than one request's TTFT near its SLO: on 70B mix at TPOT <= 20 ms `auto` prefilled
    # 4.6% of prompts on its decode worker and missed twice the threshold rule's TPOTs.
    # Capped higher, a remote prefill won against a queue well past the TTFT SLO, and with one
    # prefill worker (70B agentic at TPOT <= 20 ms, 1P:3D) TTFTs passed the SLO: at a cap of
    # 1.0, 0.75 against 0.94 of requests within SLO at 52 req/s; at 0.25, 0.98
    # (docs/benchmarks/simulation.md, session 12).
    stall_miss_cap: float = 0.25
    # ... except a breach the decode worker's measured step says is certain: more than this
    # share past the TPOT SLO (`certain_stall_misses`). Within it, the stall is a shift no
    # larger than the step's own spread: on 70B chat at TPOT <= 20 ms (1P:3D, chunk 256) the
    # decode workers step at 18.6-19.6 ms (p10-p90) and prefill 75% of prompts locally, each a
    # 16-43 ms stall; with no margin, the stalls that crossed 20 ms went to the one prefill
    # worker, whose queue broke TTFT (0.875 within SLO at 94.92 req/s, held at 0.90 before).
    tpot_noise: float = 0.05


def certain_stall_misses(stalled, step_s, stall_s, max_tokens: int, tpot_slo_s: float, w: Weights):
    """A local prefill's TPOT misses that no cap may hide: the SLO overshoot of the decode
    worker's measured step (`step_s`, CostModel.step_seconds: what its batch sees now) with the
    stall spread over this request's max_tokens (the best guess of its neighbours' outputs),
    once per stalled request, where it is more than w.tpot_noise past the SLO. The capped
    breach is a prediction (the fitted step at the batch counting queued requests, the stall
    spread over 32 tokens); this is one the batch's own steps say will happen. On 70B rag at
    TPOT <= 18 ms (3P:1D, chunk 1024) `auto` prefilled 0.3% of prompts on a decode worker that
    stepped at 16.6-17.5 ms (p10-p90), each a ~0.2 s stall, to rescue their TTFTs from a
    prefill queue predicted at 1.3-1.6 s, and trailed the split at every rate tried (0.904
    against 0.920 within SLO at 7.7 req/s). The predicted step, ~20 ms there and at TPOT <=
    20 ms alike, could not tell that batch's 0.5 ms of headroom from the other's 2.5 ms
    (docs/benchmarks/simulation.md, session 20). Scalars or numpy arrays alike
    (router/option_matrix.py prices every option at once)."""
    over = (step_s + stall_s / max(1, max_tokens)) / tpot_slo_s - 1
    return np.where(over > w.tpot_noise, stalled * over, 0.0)


@dataclass
class Estimate:
    """One option's predicted numbers; `objective` is what the cost policy minimizes."""

    prefill_worker: str | None  # None: the decode worker prefills locally
    decode_worker: str
    ttft_s: float
    tpot_s: float
    stall_s: float  # how long D's running decodes pause for this request's local prefill
    compute_s: float  # prefill compute of the uncached tokens, on whichever worker prefills
    transfer_blocks: int
    prefill_cached_blocks: int  # prefix blocks the prefilling worker already holds
    decode_cached_blocks: int
    objective: float = 0.0
    infeasible: str | None = None  # why this option cannot be taken now
    # A local prefill that pulls a peer's longer prefix first (--peer-pull, router/peer_pull.py):
    # the prompt's blocks it has once the pull ends (0: no pull), and the pull's seconds.
    pulled_blocks: int = 0
    pull_s: float = 0.0
    # A remote prefill on a hybrid worker: how long it pauses that worker's own decodes, the
    # requests there now (running and queued), and their TPOT without it (0: not hybrid).
    prefill_stall_s: float = 0.0
    prefill_stalled: int = 0
    prefill_tpot_s: float = 0.0
    load: int = 0
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.prefill_worker}->{self.decode_worker}" if self.prefill_worker else (
            f"local@{self.decode_worker}"
        )  # fmt: skip


def estimate(
    request: RoutingRequest,
    prefill: WorkerLoad | None,
    decode: WorkerLoad,
    cached: dict[str, int],
    cost: CostModel,
    peer_blocks: int | None = None,
) -> Estimate:
    """Predicts TTFT, TPOT and the stall of one option (objective filled in by `objective`).
    `peer_blocks` (with --peer-pull): the longest prefix of the prompt another decode worker
    holds, which a local prefill on `decode` may pull (`router/peer_pull.peer_blocks`)."""
    d_cached = min(cached.get(decode.worker_id, 0), request.full_blocks)
    batch = decode.num_running + decode.queued_requests + 1  # D's batch once this one joins
    tpot = cost.decode_step_seconds(batch)
    pulled, pull_s = 0, 0.0
    p_stall, p_before, p_tpot = 0.0, 0, 0.0
    if prefill is None:
        wait = cost.prefill_queue_seconds(decode.queued_tokens, decode.queued_requests, local=True)
        uncached = request.uncached_tokens(d_cached)
        compute = cost.prefill_seconds(uncached, local=True)
        if peer_blocks is not None and peer_blocks > d_cached and request.bytes_per_block:
            # The pull, when it beats recomputing what it brings (PULL_MARGIN): D then
            # computes only the tokens past the peer's prefix, once the pull ends.
            pulled_s = pull_seconds(cost, peer_blocks - d_cached, request.bytes_per_block)
            pulled_uncached = request.uncached_tokens(peer_blocks)
            pulled_compute = cost.prefill_seconds(pulled_uncached, local=True)
            if pulled_s < PULL_MARGIN * (compute - pulled_compute):
                pulled, pull_s = peer_blocks, pulled_s
                uncached, compute = pulled_uncached, pulled_compute
        # What the prompt's chunks add to D's steps (its compute, measured): the TTFT's line
        # also holds the decode work the chunks share steps with, which stalls nobody.
        stall = cost.stall_seconds(uncached)
        ttft, blocks, p_cached = wait + pull_s + compute, 0, d_cached
    else:
        p_cached = min(cached.get(prefill.worker_id, 0), request.full_blocks)
        # A hybrid worker's steps also decode: its queue and prefill are priced as a decode
        # worker's own (`local`).
        hybrid = prefill.hybrid
        wait = cost.prefill_queue_seconds(
            prefill.queued_tokens, prefill.queued_requests, local=hybrid
        )
        compute = cost.prefill_seconds(request.uncached_tokens(p_cached), local=hybrid)
        blocks = request.total_blocks - d_cached  # only the blocks D lacks travel
        transfer = cost.transfer_seconds(blocks * request.bytes_per_block)
        # The first token reaches the client before the push (prefill_service/worker.py), but
        # the stream then pauses for it: counted here, so the handoff keeps a price (and a
        # decode worker already holding the prefix, which needs less of it, stays preferred).
        # The handoff's round trips (reserve, call, first answer) as measured: what a short
        # prompt's local prefill saves.
        ttft, stall = wait + compute + transfer + cost.handoff_seconds(), 0.0
        if hybrid:  # its chunks share its own decodes' steps, as a local prefill's
            p_before = prefill.num_running + prefill.queued_requests
            p_stall = cost.stall_seconds(request.uncached_tokens(p_cached))
            p_tpot = cost.decode_step_seconds(max(1, p_before))
    return Estimate(
        prefill_worker=prefill.worker_id if prefill else None,
        decode_worker=decode.worker_id,
        ttft_s=ttft,
        tpot_s=tpot,
        stall_s=stall,
        compute_s=compute,
        transfer_blocks=blocks,
        prefill_cached_blocks=p_cached,
        decode_cached_blocks=d_cached,
        load=decode.load + (prefill.load if prefill else 0),
        pulled_blocks=pulled,
        pull_s=pull_s,
        prefill_stall_s=p_stall,
        prefill_stalled=p_before,
        prefill_tpot_s=p_tpot,
    )


def objective(
    est: Estimate,
    request: RoutingRequest,
    decode: WorkerLoad,
    cost: CostModel,
    ttft_slo_s: float,
    tpot_slo_s: float,
    w: Weights,
    best_ttft_s: float = 0.0,
) -> float:
    """Fills `est.objective` (lower is better) and `est.terms`, and returns it:

    ttft/ttft_slo + w.tpot * tpot/tpot_slo                    this request
    + w.compute * prefill compute / ttft_slo                   later requests (pool throughput)
    + w.interference * (running * dTPOT + stalled * stall/S) / tpot_slo   D's other requests
                  (stalled: D's requests now plus w.stall_newcomers arriving during the stall;
                  a remote prefill on a hybrid worker stalls that worker's requests alike)
    + w.slo_penalty * (SLO overshoot of TTFT (from            a miss costs more than slowness
                       w.ttft_margin below its SLO) and TPOT,
                       and of D's TPOT with the stall, once per request stalled and at
                       most w.stall_miss_cap: its decode step plus the local prefill's
                       measured compute spread as in the interference term; of a hybrid
                       prefill worker's, for a remote prefill there; uncapped on a decode
                       worker whose measured step the stall puts more than w.tpot_noise
                       past the SLO: `certain_stall_misses`)
    + w.kv_pressure * (KV occupancy above the soft limit       preemption risk on D
                       that this request adds)

    `best_ttft_s`: the lowest TTFT of any option that can be taken now. When even that misses the
    TTFT SLO the miss is unavoidable and charged to no option, so a long prompt whose prefill
    alone outlasts the SLO is placed by the other terms: the penalty's steep slope on the
    transfer time would send it to a decode worker, stalling its decodes for seconds to save
    milliseconds.
    """
    ttft_n, tpot_n = est.ttft_s / ttft_slo_s, est.tpot_s / tpot_slo_s
    bar = 1 - w.ttft_margin  # the TTFT the penalty starts at, in SLO units
    ttft_miss = max(0.0, ttft_n - bar) if best_ttft_s <= ttft_slo_s else 0.0
    before = decode.num_running + decode.queued_requests  # D's batch without this request
    slowdown = est.tpot_s - cost.decode_step_seconds(max(1, before))
    # A local prefill pauses D's running decodes, and the requests queued behind it too.
    amortize = max(1, min(w.stall_amortize_tokens, request.max_tokens))
    stalled = before + w.stall_newcomers if est.stall_s else 0.0
    harm = decode.num_running * max(0.0, slowdown) + stalled * est.stall_s / amortize
    # The stalled requests' TPOT while a local prefill's chunks share D's steps: beyond the
    # SLO, a long prompt beside a TPOT-bound batch costs the batch its SLO, not some speed,
    # so the overshoot is charged once per stalled request, up to the cap (Weights).
    stalled_tpot_n = (est.tpot_s + est.stall_s / amortize) / tpot_slo_s
    stall_miss = min(w.stall_miss_cap, stalled * max(0.0, stalled_tpot_n - 1))
    step_s = cost.step_seconds(decode.worker_id)
    if est.stall_s and not decode.hybrid and step_s is not None:  # hybrid: every option stalls
        certain = certain_stall_misses(
            stalled, step_s, est.stall_s, request.max_tokens, tpot_slo_s, w
        )
        stall_miss = max(stall_miss, float(certain))
    if est.prefill_stall_s:  # a hybrid prefill worker's own decodes pause, as D's would
        p_stalled = est.prefill_stalled + w.stall_newcomers
        harm = harm + p_stalled * est.prefill_stall_s / amortize
        p_tpot_n = (est.prefill_tpot_s + est.prefill_stall_s / amortize) / tpot_slo_s
        stall_miss = min(w.stall_miss_cap, p_stalled * max(0.0, p_tpot_n - 1))
    terms = {
        "ttft": ttft_n,
        "tpot": w.tpot * tpot_n,
        "compute": w.compute * est.compute_s / ttft_slo_s,
        "interference": w.interference * harm / tpot_slo_s,
        "slo_penalty": w.slo_penalty * (ttft_miss + max(0.0, tpot_n - 1) + stall_miss),
    }
    if decode.num_blocks:
        needed = request.decode_blocks(est.decode_cached_blocks)
        held_blocks = (
            decode.num_blocks - decode.num_free_blocks + decode.inflight_blocks
            + decode.reused_blocks
        )  # fmt: skip
        held = held_blocks / decode.num_blocks
        after = held + needed / decode.num_blocks
        # What this request adds to the occupancy above the limit, not the occupancy: charged
        # the whole of it, a worker whose running requests share a tenant's cached prefix
        # looked riskier for a turn needing 12 blocks there than a worker that would compute
        # and hold 260 (evicting other tenants' prefixes), and at saturation turns left their
        # cache (docs/benchmarks/routing.md, seventh part). Held also counts what the router
        # sent there since the snapshot and the cached prefixes requests there reuse: without
        # them a worker whose pool its tenants' prefixes filled took one more cold prefix
        # (three routed within one poll interval, each seeing the same free blocks), and its
        # turns then queued for KV (ninth part).
        over = max(0.0, after - w.kv_soft_limit) - max(0.0, held - w.kv_soft_limit)
        terms["kv_pressure"] = w.kv_pressure * over / (1 - w.kv_soft_limit)
    est.terms = terms
    total = 0.0
    for value in terms.values():  # left to right, as router/option_matrix.py adds its vectors
        total += value
    est.objective = total
    return est.objective
