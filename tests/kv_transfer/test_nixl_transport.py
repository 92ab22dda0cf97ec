"""The nixl transport on CPU over UCX: the other transports' contract, KV moved by a NIXL READ
straight from the prefill cache's blocks into the reserved ones.

The receiver and most senders share this process (two NIXL agents talking over UCX); one test
runs the sender in a child process, and the frozen-peer tests freeze a child process that holds
the registered KV (SIGSTOP), so its READ can never finish.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time

import grpc
import pytest
import torch

from kv_transfer import CommitInfo, KVLayout, KVTransferError, TransferRequest, make_receiver
from kv_transfer.grpc_common import SECRET_METADATA_KEY, SERVICE
from kv_transfer.grpc_sender import ControlStub
from kv_transfer.nixl_agent import make_agent, memory_type
from kv_transfer.nixl_sender import NixlKVSender
from kv_transfer.reservations import TransferState
from pdserve.pb import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_helpers import NUM_BLOCKS, NUM_LAYERS, TensorSink, make_cache, reader

pytest.importorskip("nixl_cu12")

TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
SRC, DEST = [1, 2, 5], [3, 7, 9]


@pytest.fixture
def nixl_config(config):
    return dataclasses.replace(
        config, transport="nixl", reservation_timeout_s=10.0, nixl_ucx_tls="tcp"
    )


@pytest.fixture
def nixl_receiver(nixl_config, sink):
    receiver = make_receiver(nixl_config, sink, KVLayout.of(sink.cache), kv_cache=sink.cache)
    receiver.start()
    yield receiver
    receiver.stop()


@pytest.fixture
def nixl_sender(nixl_config, src_cache):
    sender = NixlKVSender(nixl_config, src_cache)
    yield sender
    sender.close()


def request(endpoint: str, src_cache, transfer_id: str, src=SRC) -> TransferRequest:
    return TransferRequest(
        endpoint, transfer_id, src, NUM_LAYERS, reader(src_cache), CommitInfo(42, -0.5, 11), TRACE
    )


def pull_call(endpoint: str):
    stub = ControlStub.dial(endpoint)
    call = stub.channel.unary_unary(
        f"/{SERVICE}/PullKV",
        request_serializer=pb.PullKVRequest.SerializeToString,
        response_deserializer=pb.PullKVResponse.FromString,
    )
    return stub, call


def test_blocks_arrive_bit_exact_and_commit_carries_first_token(
    nixl_receiver, nixl_sender, sink, src_cache
):
    for _ in range(2):  # the second transfer reuses both agents and the connection
        tid = nixl_receiver.open(DEST, deadline_s=10)
        result = nixl_sender.send(request(nixl_receiver.endpoint, src_cache, tid))
        assert sink.commits[tid].first_token_id == 42
        assert sink.commits[tid].trace_context == TRACE
        assert nixl_receiver.state(tid) is TransferState.COMMITTED
    assert torch.equal(sink.cache[:, :, DEST], src_cache[:, :, SRC])
    others = [b for b in range(NUM_BLOCKS) if b not in DEST]
    assert not sink.cache[:, :, others].any()
    assert result.bytes == src_cache[:, :, SRC].nbytes


def test_bfloat16_cache_and_shared_memory_transport(nixl_config):
    """UCX over shared memory (one host), another dtype, and scattered destination blocks."""
    config = dataclasses.replace(nixl_config, nixl_ucx_tls="shm,tcp")
    sink = TensorSink(make_cache(None, torch.bfloat16))
    receiver = make_receiver(config, sink, KVLayout.of(sink.cache), kv_cache=sink.cache)
    receiver.start()
    src_cache, src, dest = make_cache(3, torch.bfloat16), [0, 15, 4, 8], [12, 0, 6, 5]
    sender = NixlKVSender(config, src_cache)
    try:
        tid = receiver.open(dest, deadline_s=10)
        sender.send(request(receiver.endpoint, src_cache, tid, src))
    finally:
        sender.close()
        receiver.stop()
    assert tid in sink.commits
    assert torch.equal(sink.cache[:, :, dest], src_cache[:, :, src])


def test_runs_of_blocks_partly_consecutive_arrive_bit_exact(nixl_receiver, nixl_sender, sink):
    """Source and reserved blocks consecutive only in parts (runs [2-4]->[5-7], 9->8, 10->12):
    each run is one descriptor per plane, and nothing outside the reserved blocks changes."""
    src_cache, src, dest = make_cache(1), [2, 3, 4, 9, 10], [5, 6, 7, 8, 12]
    tid = nixl_receiver.open(dest, deadline_s=10)
    result = nixl_sender.send(request(nixl_receiver.endpoint, src_cache, tid, src))
    assert tid in sink.commits and result.bytes == src_cache[:, :, src].nbytes
    assert torch.equal(sink.cache[:, :, dest], src_cache[:, :, src])
    assert not sink.cache[:, :, [b for b in range(NUM_BLOCKS) if b not in dest]].any()


@pytest.mark.parametrize("fate", ["unknown", "aborted", "expired"])
def test_pulls_for_dead_transfer_ids_are_rejected(nixl_receiver, nixl_sender, sink, fate):
    tid = nixl_receiver.open(DEST, deadline_s=0.2 if fate == "expired" else 10)
    if fate == "unknown":
        tid = "not-a-real-transfer-id"
    elif fate == "aborted":
        nixl_receiver.abort(tid)
    else:
        time.sleep(0.4)
    code = "NOT_FOUND" if fate == "unknown" else "FAILED_PRECONDITION"
    with pytest.raises(KVTransferError, match=code):
        nixl_sender.send(request(nixl_receiver.endpoint, make_cache(1), tid))
    assert sink.commits == {} and not sink.cache.any()


def test_abort_is_idempotent_on_both_sides(nixl_receiver, nixl_sender, sink):
    tid = nixl_receiver.open(DEST, deadline_s=10)
    nixl_sender.abort(nixl_receiver.endpoint, tid)
    nixl_sender.abort(nixl_receiver.endpoint, tid)
    assert nixl_receiver.abort(tid) is False
    assert sink.expired == [tid] and nixl_receiver.state(tid) is TransferState.ABORTED


def test_deadline_expiry_frees_the_blocks(nixl_receiver, sink):
    tid = nixl_receiver.open(DEST, deadline_s=0.2)
    assert sink.changed.wait(timeout=5)
    assert sink.expired == [tid] and nixl_receiver.open_transfer_ids() == []


def test_corrupted_kv_is_never_committed(nixl_receiver, nixl_config, sink, src_cache):
    """KV that differs from what the sender checksummed (as KV changed in transit would) fails
    the comparison with the landed checksum: the sender aborts instead of committing, and the
    blocks are freed; the source cache itself is untouched."""
    original = src_cache.clone()

    def flip(seq: int, data: torch.Tensor) -> None:
        data.view(-1)[7] += 1.0

    sender = NixlKVSender(nixl_config, src_cache, tamper=flip)
    tid = nixl_receiver.open(DEST, deadline_s=10)
    try:
        with pytest.raises(KVTransferError, match="DATA_LOSS.*checksum mismatch"):
            sender.send(request(nixl_receiver.endpoint, src_cache, tid))
    finally:
        sender.close()
    assert sink.commits == {} and sink.expired == [tid]
    assert nixl_receiver.state(tid) is TransferState.ABORTED
    assert torch.equal(src_cache, original)


def test_wrong_secret_is_refused(nixl_receiver, nixl_config, sink):
    sender = NixlKVSender(dataclasses.replace(nixl_config, secret="wrong"), make_cache(1))
    tid = nixl_receiver.open(DEST, deadline_s=10)
    with pytest.raises(KVTransferError, match="UNAUTHENTICATED"):
        sender.send(request(nixl_receiver.endpoint, make_cache(1), tid))
    sender.close()
    assert not sink.cache.any() and nixl_receiver.state(tid) is TransferState.OPEN


def test_bad_pull_requests_name_the_field_and_the_receiver_keeps_serving(
    nixl_receiver, nixl_sender, nixl_config, sink
):
    stub, call = pull_call(nixl_receiver.endpoint)
    metadata = ((SECRET_METADATA_KEY, nixl_config.secret),)
    src = make_cache(1)[:, :, SRC].contiguous()
    header = pb.ChunkHeader(
        layer_start=0, layer_end=NUM_LAYERS, num_layers=NUM_LAYERS, dtype="float32",
        shape=list(src.shape),
    )  # fmt: skip
    cases = {
        "agent_metadata": dict(agent_metadata=b"garbage", address=src.data_ptr(), memory="DRAM"),
        "memory": dict(agent_metadata=b"x", address=src.data_ptr(), memory="DISK"),
        "src_block_ids": dict(memory="DRAM", src_block_ids=[0, 1, 99], src_num_blocks=16),
        # the header's 2 heads from head 1 of a 2-head source: past its end
        "src_head_start": dict(memory="DRAM", src_num_heads=2, src_head_start=1),
    }
    try:
        for field_name, fields in cases.items():
            tid = nixl_receiver.open(DEST, deadline_s=10)
            header.transfer_id = tid
            with pytest.raises(grpc.RpcError) as info:
                call(pb.PullKVRequest(header=header, **fields), metadata=metadata, timeout=10)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert field_name in info.value.details()
            assert nixl_receiver.state(tid) is TransferState.FAILED and tid in sink.expired
        tid = nixl_receiver.open(DEST, deadline_s=10)  # three blocks reserved, two named
        header.transfer_id = tid
        with pytest.raises(grpc.RpcError) as info:
            call(
                pb.PullKVRequest(
                    header=header, memory="DRAM", src_block_ids=[0, 1], src_num_blocks=16
                ),
                metadata=metadata,
                timeout=10,
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "src_block_ids names 2 blocks for 3 reserved" in info.value.details()
        tid = nixl_receiver.open(DEST[:2], deadline_s=10)  # two blocks reserved, three offered
        header.transfer_id = tid
        with pytest.raises(grpc.RpcError) as info:
            call(pb.PullKVRequest(header=header, memory="DRAM"), metadata=metadata, timeout=10)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "shape" in info.value.details()
    finally:
        stub.channel.close()
    assert not sink.cache.any()
    tid = nixl_receiver.open(DEST, deadline_s=10)
    nixl_sender.send(request(nixl_receiver.endpoint, make_cache(1), tid))
    assert tid in sink.commits


def test_receiver_needs_the_kv_cache(nixl_config, sink):
    with pytest.raises(ValueError, match="kv_cache"):
        make_receiver(nixl_config, sink, KVLayout.of(sink.cache))


def _send_from_child(endpoint: str, config, transfer_id: str, conn) -> None:
    """Child process: a prefill side of its own, sending the blocks of seed-1 cache."""
    sender = NixlKVSender(config, make_cache(1))
    try:
        result = sender.send(request(endpoint, make_cache(1), transfer_id))
        conn.send(("ok", result.bytes))
    except KVTransferError as exc:
        conn.send(("error", str(exc)))
    finally:
        sender.close()


def test_sender_in_another_process(nixl_receiver, nixl_config, sink):
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    tid = nixl_receiver.open(DEST, deadline_s=60)
    child = ctx.Process(
        target=_send_from_child, args=(nixl_receiver.endpoint, nixl_config, tid, child_end)
    )
    child.start()
    assert parent.poll(60)
    outcome = parent.recv()
    child.join(timeout=30)
    assert outcome == ("ok", make_cache(1)[:, :, SRC].nbytes)
    assert tid in sink.commits
    assert torch.equal(sink.cache[:, :, DEST], make_cache(1)[:, :, SRC])


def _hold_registered_kv(ucx_tls: str, conn) -> None:
    """Child process: registers KV with a NIXL agent, reports how to read it, then waits (the
    parent freezes it with SIGSTOP)."""
    agent = make_agent("frozen", ucx_tls)
    data = make_cache(1)[:, :, SRC].contiguous()
    registration = agent.register_memory(data)
    metadata = agent.get_partial_agent_metadata(registration, inc_conn_info=True)
    conn.send((metadata, data.data_ptr(), memory_type(data)[0]))
    time.sleep(120)


@pytest.fixture(scope="module")
def frozen_peer():
    """(agent metadata, address, memory) of KV held by a frozen process."""
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_hold_registered_kv, args=("tcp", child_end))
    child.start()
    assert parent.poll(60)
    held = parent.recv()
    os.kill(child.pid, signal.SIGSTOP)
    yield held
    child.kill()
    child.join(timeout=10)


def _pull_frozen(receiver, config, frozen_peer, tid: str, timeout: float):
    metadata, address, memory = frozen_peer
    src = make_cache(1)[:, :, SRC]
    header = pb.ChunkHeader(
        transfer_id=tid, layer_start=0, layer_end=NUM_LAYERS, num_layers=NUM_LAYERS,
        dtype="float32", shape=list(src.shape), checksum=1, trace_context=TRACE,
    )  # fmt: skip
    stub, call = pull_call(receiver.endpoint)
    try:
        call(
            pb.PullKVRequest(
                header=header, agent_metadata=metadata, address=address, memory=memory
            ),
            metadata=((SECRET_METADATA_KEY, config.secret),),
            timeout=timeout,
        )
    finally:
        stub.channel.close()


def test_frozen_sender_cannot_hold_the_receiver_past_the_deadline(
    nixl_receiver, nixl_config, sink, frozen_peer, nixl_sender
):
    tid = nixl_receiver.open(DEST, deadline_s=2.0)
    opened = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        _pull_frozen(nixl_receiver, nixl_config, frozen_peer, tid, timeout=30)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert time.monotonic() - opened < 2.0 + 1.5
    assert sink.changed.wait(timeout=5)
    assert sink.expired == [tid] and nixl_receiver.open_transfer_ids() == []
    tid2 = nixl_receiver.open(DEST, deadline_s=10)  # a healthy sender is still served
    nixl_sender.send(request(nixl_receiver.endpoint, make_cache(1), tid2))
    assert tid2 in sink.commits


@pytest.mark.parametrize("by", ["decode worker", "remote sender"])
def test_abort_stops_an_in_flight_read(
    nixl_receiver, nixl_config, nixl_sender, sink, frozen_peer, by
):
    """Either abort fences the READ: it returns once the READ stopped; a remote abort also
    frees the blocks (on_expired), the decode worker's own frees them itself."""
    tid = nixl_receiver.open(DEST, deadline_s=30)
    failure: list[grpc.RpcError] = []

    def pull() -> None:
        try:
            _pull_frozen(nixl_receiver, nixl_config, frozen_peer, tid, timeout=30)
        except grpc.RpcError as exc:
            failure.append(exc)

    puller = threading.Thread(target=pull)
    puller.start()
    time.sleep(0.5)  # the READ is posted and cannot finish
    started = time.monotonic()
    if by == "decode worker":
        assert nixl_receiver.abort(tid) is True
    else:
        nixl_sender.abort(nixl_receiver.endpoint, tid)
    assert time.monotonic() - started < 2.0  # returns once the READ stopped
    puller.join(timeout=10)
    assert failure and failure[0].code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "aborted" in failure[0].details()
    assert sink.expired == ([] if by == "decode worker" else [tid])
    assert nixl_receiver.state(tid) is TransferState.ABORTED
    assert not sink.cache.any()  # a frozen source never delivered a byte
