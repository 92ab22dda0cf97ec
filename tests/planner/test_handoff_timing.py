"""The virtual cluster's timing of what the live system does between engine steps: a stats poll
is answered between two steps (WorkerRuntime.stats is an engine call), and a disaggregated
request's first token reaches the client at the end of its prefill step, while its decode tokens
follow only once the prefill worker released its blocks (prefill_service/worker.py answers the
router a second time after the release), which waits for that worker's step in progress."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.planner.cluster import RouterTiming, VirtualCluster
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.workload import ProbeRequest

LOOSE = SLO(ttft_ms=1e6, tpot_ms=1e6)


@pytest.fixture(scope="module")
def deployment(planner_model_dir) -> Deployment:
    return Deployment(
        str(planner_model_dir), max_num_seqs=8, max_num_batched_tokens=2048, num_kv_blocks=1024
    )


def _request(index: int, prompt_len: int, output_len: int, arrival: float) -> ProbeRequest:
    prompt = [2 + (7 * index + i) % 250 for i in range(prompt_len)]
    return ProbeRequest(index, prompt, output_len, arrival)


def test_a_poll_during_a_step_is_answered_at_its_end(deployment):
    router = RouterConfig(disaggregate="never", ttft_slo_ms=1e6, tpot_slo_ms=1e6)
    cluster = VirtualCluster(deployment, 0, 1, router, RouterTiming(poll_interval_s=0.001))
    answered: list[float] = []
    cluster.pool.stats_listeners.append(lambda w, old, new: answered.append(cluster.loop.now))
    worker = cluster.workers["decode-0"]
    request = _request(0, 2000, 1, 0.0)
    worker.call(lambda: worker.engine.add_request("r0", request.prompt, _params(1)))
    cluster.loop.run(lambda: cluster.loop.now > 0.5)
    step = worker.busy_seconds  # the one prefill step, from 0
    assert 0.01 < step < 0.4  # far longer than the poll interval
    # the poll due 1 ms in waited for the step's end; the next came 1 ms after that answer
    assert answered[:2] == [pytest.approx(step), pytest.approx(step + 0.001)]


def test_the_decode_tokens_wait_for_the_release_on_a_busy_prefill_worker(deployment):
    router = RouterConfig(disaggregate="always", ttft_slo_ms=1e6, tpot_slo_ms=1e6)
    # A's prompt is one prefill step, B's (arriving just after) the next one on the same worker
    sample = [_request(0, 2000, 4, 0.0), _request(1, 2000, 4, 1e-6)]
    _, (a, b) = run_probe(
        deployment, Split(1, 1), sample, 1.0, LOOSE, router, stop_when_certain=False
    )
    assert a.route.prefill_worker and b.route.prefill_worker
    b_prefilled = b.record.send_time + b.prefill_result.queue_s + b.prefill_result.prefill_s
    a_prefilled = a.record.send_time + a.prefill_result.queue_s + a.prefill_result.prefill_s
    a_committed = a_prefilled + a.prefill_result.transfer_s
    assert a_committed < b_prefilled  # A's handoff was done while B's step ran
    assert a.record.chunk_times[0] == pytest.approx(a_prefilled)  # the first token at once
    assert a.record.chunk_times[1] == pytest.approx(b_prefilled)  # the rest after the release
    # decode outputs made meanwhile follow the first token, in order, none lost
    assert a.record.chunk_times == sorted(a.record.chunk_times)
    assert a.record.output_tokens == 4 and a.record.ok


def _params(max_tokens: int):
    from pdserve.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
