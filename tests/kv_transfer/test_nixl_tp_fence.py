"""nixl between tensor-parallel workers: an abort on decode rank 0 fences a READ in flight on
another decode rank (a strided head subset, one descriptor per position, from a prefill rank
frozen with SIGSTOP so the READ cannot finish): rank 0's abort returns only once that READ
stopped, every rank's part ends ABORTED, and not a byte landed in the rank's cache."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time

import grpc
import pytest

from kv_transfer.grpc_common import SECRET_METADATA_KEY
from kv_transfer.nixl_agent import make_agent, memory_type
from kv_transfer.reservations import TransferState
from pdserve.bench.transfer.tp_ranks import SMALL_CACHE, DecodeRanks, reference_cache
from pdserve.pb import kv_transfer_pb2 as pb
from tests.kv_transfer.test_nixl_transport import pull_call

pytest.importorskip("nixl_cu12")

SRC, DEST = [1, 2, 5], [3, 7, 9]
KV_HEADS = 4
LAYERS, BLOCKS = SMALL_CACHE.layers, SMALL_CACHE.blocks


def _hold_prefill_cache(conn) -> None:
    """Child process: a TP-1 prefill rank's whole cache registered with its own agent; reports
    how to read it, then waits (the parent freezes it)."""
    agent = make_agent("frozen-prefill", "tcp")
    cache = reference_cache(KV_HEADS)
    registration = agent.register_memory(cache)
    metadata = agent.get_partial_agent_metadata(registration, inc_conn_info=True)
    conn.send((metadata, cache.data_ptr(), memory_type(cache)[0]))
    time.sleep(120)


@pytest.fixture
def frozen_prefill():
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_hold_prefill_cache, args=(child_end,))
    child.start()
    assert parent.poll(60)
    held = parent.recv()
    os.kill(child.pid, signal.SIGSTOP)
    yield held
    child.kill()
    child.join(timeout=10)


def test_rank_zeros_abort_stops_a_read_in_flight_on_another_rank(config, frozen_prefill):
    nixl = dataclasses.replace(config, transport="nixl", nixl_ucx_tls="tcp")
    decode = DecodeRanks(nixl, KV_HEADS, 2)  # rank 1 holds heads 2 and 3
    metadata, address, memory = frozen_prefill
    tid = decode.ranked.open(DEST, deadline_s=30)
    header = pb.ChunkHeader(
        transfer_id=tid, layer_start=0, layer_end=LAYERS, num_layers=LAYERS, dtype="float32",
        shape=list(decode.sinks[1].cache[:, :, DEST].shape), kv_head_start=2,
    )  # fmt: skip
    # Heads 2 and 3 of the TP-1 prefill cache's 4: strided there, one descriptor per position.
    request = pb.PullKVRequest(
        header=header, agent_metadata=metadata, address=address, memory=memory,
        src_block_ids=SRC, src_num_blocks=BLOCKS, src_num_heads=KV_HEADS, src_head_start=2,
    )  # fmt: skip
    failure: list[grpc.RpcError] = []
    stub, call = pull_call(decode.ranked.endpoints[1])

    def pull() -> None:
        try:
            call(request, metadata=((SECRET_METADATA_KEY, nixl.secret),), timeout=30)
        except grpc.RpcError as exc:
            failure.append(exc)

    puller = threading.Thread(target=pull)
    try:
        puller.start()
        time.sleep(0.5)
        assert puller.is_alive()  # the READ is posted on rank 1 and cannot finish
        started = time.monotonic()
        assert decode.ranked.abort(tid) is True
        assert time.monotonic() - started < 2.0  # returned once rank 1's READ stopped
        puller.join(timeout=10)
        assert failure and failure[0].code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "aborted" in failure[0].details()
        for receiver in decode.receivers():
            assert receiver.state(tid) is TransferState.ABORTED
            assert receiver.open_transfer_ids() == []
        assert not any(sink.cache.any() for sink in decode.sinks)
    finally:
        stub.channel.close()
        decode.stop()
