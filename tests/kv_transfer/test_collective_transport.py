"""The collective transport on Gloo (CPU): same semantics as grpc, payloads via torch.distributed.

Most tests run both ranks of the pair in this process (the receiver forms its side on a gRPC
thread); one runs them in two Ray actors, one kills a sender process mid-transfer.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import threading
import time

import grpc
import pytest
import torch

from kv_transfer import CommitInfo, KVLayout, KVTransferError, TransferRequest, make_receiver
from kv_transfer.collective_sender import CollectiveKVSender
from kv_transfer.grpc_sender import ControlStub
from kv_transfer.reservations import TransferState
from pdserve.pb import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_helpers import NUM_LAYERS, make_cache, reader

TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
SRC, DEST = [1, 2, 5], [3, 7, 9]


@pytest.fixture
def coll_config(config):
    return dataclasses.replace(config, transport="collective", reservation_timeout_s=10.0)


@pytest.fixture
def coll_receiver(coll_config, sink):
    receiver = make_receiver(coll_config, sink, KVLayout.of(sink.cache))
    receiver.start()
    yield receiver
    receiver.stop()


def request(endpoint: str, src_cache, transfer_id: str) -> TransferRequest:
    return TransferRequest(
        endpoint, transfer_id, SRC, NUM_LAYERS, reader(src_cache), CommitInfo(42, -0.5, 11), TRACE
    )


def test_blocks_arrive_bit_exact_and_commit_carries_first_token(coll_receiver, coll_config, sink):
    src_cache = make_cache(1)
    sender = CollectiveKVSender(coll_config)
    try:
        for _ in range(2):  # the second transfer reuses the pair's process group
            tid = coll_receiver.open(DEST, deadline_s=10)
            result = sender.send(request(coll_receiver.endpoint, src_cache, tid))
            assert sink.commits[tid].first_token_id == 42
            assert sink.commits[tid].trace_context == TRACE
    finally:
        sender.close()
    assert torch.equal(sink.cache[:, :, DEST], src_cache[:, :, SRC])
    assert not sink.cache[:, :, [b for b in range(sink.cache.shape[2]) if b not in DEST]].any()
    assert (result.chunks, result.bytes) == (NUM_LAYERS, src_cache[:, :, SRC].nbytes)
    assert sink.written_by == set(sink.commits)  # chunks reach the sink with their transfer id


@pytest.mark.parametrize("fate", ["unknown", "aborted", "expired"])
def test_chunks_for_dead_transfer_ids_are_rejected(coll_receiver, coll_config, sink, fate):
    tid = coll_receiver.open(DEST, deadline_s=0.2 if fate == "expired" else 10)
    if fate == "unknown":
        tid = "not-a-real-transfer-id"
    elif fate == "aborted":
        coll_receiver.abort(tid)
    else:
        time.sleep(0.4)
    sender = CollectiveKVSender(coll_config)
    code = "NOT_FOUND" if fate == "unknown" else "FAILED_PRECONDITION"
    with pytest.raises(KVTransferError, match=code):
        sender.send(request(coll_receiver.endpoint, make_cache(1), tid))
    sender.close()
    assert sink.writes == 0 and sink.commits == {}


def test_abort_is_idempotent_on_both_sides(coll_receiver, coll_config, sink):
    tid = coll_receiver.open(DEST, deadline_s=10)
    sender = CollectiveKVSender(coll_config)
    sender.abort(coll_receiver.endpoint, tid)
    sender.abort(coll_receiver.endpoint, tid)
    sender.close()
    assert coll_receiver.abort(tid) is False
    assert sink.expired == [tid] and coll_receiver.state(tid) is TransferState.ABORTED


def test_corrupted_chunk_fails_the_transfer(coll_receiver, coll_config, sink):
    def flip(seq: int, data: torch.Tensor) -> None:
        if seq == 1:
            data.view(-1)[7] += 1.0

    sender = CollectiveKVSender(coll_config, tamper=flip)
    tid = coll_receiver.open(DEST, deadline_s=10)
    with pytest.raises(KVTransferError, match="checksum mismatch"):
        sender.send(request(coll_receiver.endpoint, make_cache(1), tid))
    sender.close()
    assert sink.commits == {} and sink.expired == [tid]
    assert coll_receiver.state(tid) is TransferState.FAILED


def test_wrong_secret_cannot_connect(coll_receiver, coll_config):
    sender = CollectiveKVSender(dataclasses.replace(coll_config, secret="wrong"))
    tid = coll_receiver.open(DEST, deadline_s=10)
    with pytest.raises(KVTransferError, match="UNAUTHENTICATED"):
        sender.send(request(coll_receiver.endpoint, make_cache(1), tid))
    sender.close()


def _die_mid_transfer(endpoint: str, secret: str, conn) -> None:
    """Child process: joins the pair, announces a chunk of the transfer it is sent, then dies
    without sending the payload."""
    from kv_transfer.collective_group import form_group
    from kv_transfer.grpc_common import SECRET_METADATA_KEY
    from kv_transfer.rendezvous import RemoteStore

    metadata = ((SECRET_METADATA_KEY, secret),)
    stub = ControlStub.dial(endpoint)
    reply = stub.connect(pb.ConnectRequest(backend="gloo"), metadata=metadata)
    store = RemoteStore(stub.rendezvous, endpoint, reply.pair_id, metadata, 30)
    group = form_group(store, 1, "gloo", "127.0.0.1", 30)  # noqa: F841 (kept open)
    conn.send("joined")  # slow start-up (imports) is over: the parent opens the transfer now
    transfer_id = conn.recv()
    chunk = make_cache(1)[0:1, :, SRC]
    header = pb.ChunkHeader(
        transfer_id=transfer_id, layer_start=0, layer_end=1, num_layers=NUM_LAYERS,
        dtype="float32", shape=list(chunk.shape), checksum=1, pair_id=reply.pair_id,
    )  # fmt: skip
    stub.prepare(header, metadata=metadata)
    conn.send("announced")
    os._exit(1)


def test_dead_sender_cannot_hold_the_receiver_past_the_deadline(coll_receiver, coll_config, sink):
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(
        target=_die_mid_transfer, args=(coll_receiver.endpoint, coll_config.secret, child_end)
    )
    child.start()
    assert parent.poll(60) and parent.recv() == "joined"
    tid = coll_receiver.open(DEST, deadline_s=2.0)
    opened = time.monotonic()
    parent.send(tid)
    assert parent.poll(30) and parent.recv() == "announced"  # the receive is posted
    child.join(timeout=30)
    assert child.exitcode == 1
    assert sink.changed.wait(timeout=10)
    assert sink.expired == [tid] and time.monotonic() - opened < 2.0 + 1.5
    assert coll_receiver.open_transfer_ids() == []
    # The receiver still serves a healthy sender (a fresh pair is formed).
    sender = CollectiveKVSender(coll_config)
    tid2 = coll_receiver.open(DEST, deadline_s=10)
    sender.send(request(coll_receiver.endpoint, make_cache(1), tid2))
    sender.close()
    assert tid2 in sink.commits


def test_a_frozen_receiver_holds_no_send_to_another(coll_receiver, coll_config, sink):
    """A decode worker frozen (SIGSTOP) before its first transfer from this sender: its port
    accepts TCP connections but never answers Connect. Only the sends to it wait for that; a
    send to a live receiver completes meanwhile (it once waited behind the frozen Connect)."""
    frozen = socket.create_server(("127.0.0.1", 0))  # listens; never accepts nor answers
    frozen_endpoint = f"127.0.0.1:{frozen.getsockname()[1]}"
    sender = CollectiveKVSender(coll_config)
    stuck_failures = []

    def send_to_frozen() -> None:
        stuck = dataclasses.replace(request(frozen_endpoint, make_cache(1), "t"), timeout_s=8.0)
        with pytest.raises(KVTransferError) as info:
            sender.send(stuck)
        stuck_failures.append(info.value)

    stuck_thread = threading.Thread(target=send_to_frozen)
    stuck_thread.start()
    time.sleep(0.5)  # its Connect is in flight to the frozen endpoint
    tid = coll_receiver.open(DEST, deadline_s=10)
    begun = time.monotonic()
    sender.send(request(coll_receiver.endpoint, make_cache(1), tid))
    live_send_s = time.monotonic() - begun
    assert live_send_s < 3.0, f"the live send waited {live_send_s:.1f} s for the frozen one"
    assert stuck_thread.is_alive()  # still waiting on the frozen receiver meanwhile
    frozen.close()
    stuck_thread.join(timeout=10)
    sender.close()
    assert tid in sink.commits
    assert len(stuck_failures) == 1


def test_a_frozen_sender_holds_no_other_senders_chunks(coll_receiver, coll_config, sink):
    """A prefill worker frozen mid-transfer: it announced more chunks than a pair has waiters
    and sends none, so their receives wait for their deadline. Another sender's transfer
    commits meanwhile (one pool of waiters for every sender once held it until then)."""
    from kv_transfer.collective_group import form_group
    from kv_transfer.grpc_common import SECRET_METADATA_KEY
    from kv_transfer.rendezvous import RemoteStore

    metadata = ((SECRET_METADATA_KEY, coll_config.secret),)
    stub = ControlStub.dial(coll_receiver.endpoint)
    reply = stub.connect(pb.ConnectRequest(backend="gloo"), metadata=metadata)
    store = RemoteStore(stub.rendezvous, coll_receiver.endpoint, reply.pair_id, metadata, 30)
    frozen_group = form_group(store, 1, "gloo", "127.0.0.1", 30)  # joined; never sends
    chunk = make_cache(1)[0:1, :, SRC]
    for _ in range(10):  # one chunk each of ten transfers, more than any pool's threads
        header = pb.ChunkHeader(
            transfer_id=coll_receiver.open(DEST, deadline_s=6), layer_start=0, layer_end=1,
            num_layers=NUM_LAYERS, dtype="float32", shape=list(chunk.shape), checksum=1,
            pair_id=reply.pair_id,
        )  # fmt: skip
        stub.prepare(header, metadata=metadata)
    sender = CollectiveKVSender(coll_config)
    tid = coll_receiver.open(DEST, deadline_s=10)
    begun = time.monotonic()
    sender.send(request(coll_receiver.endpoint, make_cache(1), tid))
    live_send_s = time.monotonic() - begun
    sender.close()
    stub.channel.close()
    frozen_group.abort()
    assert tid in sink.commits
    assert live_send_s < 3.0, f"the live send waited {live_send_s:.1f} s for the frozen one"


def test_unknown_pair_is_refused(coll_receiver, coll_config):
    tid = coll_receiver.open(DEST, deadline_s=10)
    stub = ControlStub.dial(coll_receiver.endpoint)
    header = pb.ChunkHeader(
        transfer_id=tid, layer_start=0, layer_end=1, num_layers=NUM_LAYERS, dtype="float32",
        shape=[1, 2, 3, 4, 2, 8], pair_id="nope",
    )  # fmt: skip
    metadata = (("x-pdserve-kv-secret", coll_config.secret),)
    with pytest.raises(grpc.RpcError) as info:
        stub.prepare(header, metadata=metadata)
    stub.channel.close()
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
