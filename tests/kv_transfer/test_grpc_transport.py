"""The grpc transport end to end: a real KV endpoint on 127.0.0.1, a real sink tensor."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from kv_transfer import CommitInfo, KVLayout, KVTransferError, TransferRequest, make_receiver, wire
from kv_transfer.grpc_common import SECRET_METADATA_KEY
from kv_transfer.grpc_sender import ControlStub, GrpcKVSender
from kv_transfer.reservations import TransferState
from pdserve.pb import kv_transfer_pb2 as pb
from tests.kv_transfer.conftest import SECRET
from tests.kv_transfer.kv_helpers import NUM_LAYERS, TensorSink, make_cache, reader

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
SRC, DEST = [1, 2, 5], [3, 7, 9]


def request(receiver, src_cache, transfer_id, **overrides) -> TransferRequest:
    fields = dict(
        endpoint=receiver.endpoint,
        transfer_id=transfer_id,
        src_block_ids=SRC,
        num_layers=NUM_LAYERS,
        read_kv=reader(src_cache),
        commit=CommitInfo(first_token_id=42, first_logprob=-0.5, num_prompt_tokens=11),
        trace_context=TRACE,
    )
    return TransferRequest(**{**fields, **overrides})


def raw_chunk(
    transfer_id: str, data: torch.Tensor, layer_start: int = 0, crc_xor: int = 0, seq: int = 0
) -> bytes:
    payload = wire.tensor_bytes(data.contiguous())
    header = pb.ChunkHeader(
        transfer_id=transfer_id,
        layer_start=layer_start,
        layer_end=layer_start + data.shape[0],
        num_layers=NUM_LAYERS,
        dtype=str(data.dtype).removeprefix("torch."),
        shape=list(data.shape),
        checksum=wire.payload_checksum(payload) ^ crc_xor,
        seq=seq,
    )
    return wire.encode_chunk(header, payload)


def push_raw(receiver, chunks: list[bytes], secret: str | None = SECRET) -> None:
    metadata = ((SECRET_METADATA_KEY, secret),) if secret is not None else ()
    stub = ControlStub.dial(receiver.endpoint)
    try:
        stub.push(iter(chunks), timeout=10, metadata=metadata)
    finally:
        stub.channel.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_arrive_bit_exact_and_only_missing_blocks_travel(config, dtype):
    sink = TensorSink(make_cache(None, dtype))
    src_cache = make_cache(1, dtype)
    receiver = make_receiver(config, sink, KVLayout.of(sink.cache))
    receiver.start()
    sender = GrpcKVSender(config)
    try:
        tid = receiver.open(DEST, deadline_s=10, trace_context=TRACE)
        req = request(receiver, src_cache, tid)
        result = sender.send(req)
    finally:
        sender.close()
        receiver.stop()
    assert torch.equal(
        sink.cache[:, :, DEST].view(torch.uint8), src_cache[:, :, SRC].view(torch.uint8)
    )
    untouched = [b for b in range(sink.cache.shape[2]) if b not in DEST]
    assert not sink.cache[:, :, untouched].any()
    assert all(ids == SRC for ids in req.read_kv.reads)  # only the requested blocks were read
    # chunk_bytes is one float32 layer of these blocks, so two bfloat16 layers
    assert result.chunks == NUM_LAYERS * dtype.itemsize // 4
    assert result.bytes == src_cache[:, :, SRC].nbytes
    commit = sink.commits[tid]
    assert (commit.first_token_id, commit.num_prompt_tokens) == (42, 11)
    assert commit.first_logprob == pytest.approx(-0.5)
    assert commit.trace_context == TRACE  # the sender's trace context reaches the decode side
    assert receiver.state(tid) is TransferState.COMMITTED and sink.expired == []
    assert sink.written_by == {tid}  # every chunk reached the sink with its transfer id


def test_commit_before_every_chunk_arrived_is_rejected(receiver, sender, sink, src_cache):
    tid = receiver.open(DEST, deadline_s=10)
    push_raw(receiver, [raw_chunk(tid, src_cache[0:1, :, SRC])])
    stub = ControlStub.dial(receiver.endpoint)
    with pytest.raises(grpc.RpcError) as info:
        stub.commit(
            pb.CommitRequest(transfer_id=tid, first_token_id=1), metadata=sender._client.metadata
        )
    stub.channel.close()
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "3 layers missing" in info.value.details()
    assert sink.commits == {} and receiver.state(tid) is TransferState.OPEN


@pytest.mark.parametrize("fate", ["unknown", "aborted", "expired", "committed"])
def test_chunks_for_dead_transfer_ids_are_rejected(receiver, sender, sink, src_cache, fate):
    tid = receiver.open(DEST, deadline_s=0.2 if fate == "expired" else 10)
    if fate == "unknown":
        tid = "not-a-real-transfer-id"
    elif fate == "aborted":
        assert receiver.abort(tid)
    elif fate == "expired":
        time.sleep(0.4)
    elif fate == "committed":
        sender.send(request(receiver, src_cache, tid))
    writes = sink.writes
    with pytest.raises(grpc.RpcError) as info:
        push_raw(receiver, [raw_chunk(tid, src_cache[0:1, :, SRC])])
    expected = (
        grpc.StatusCode.NOT_FOUND if fate == "unknown" else grpc.StatusCode.FAILED_PRECONDITION
    )
    assert info.value.code() is expected
    assert sink.writes == writes  # fenced: nothing written
    with pytest.raises(KVTransferError, match=expected.name):
        sender.send(request(receiver, src_cache, tid))


def test_abort_is_idempotent_on_both_sides(receiver, sender, sink):
    local = receiver.open(DEST, deadline_s=10)
    assert receiver.abort(local) is True
    assert receiver.abort(local) is False
    assert receiver.abort("never-issued") is False
    assert sink.expired == []  # the decode worker aborted it itself: no callback

    remote = receiver.open(DEST, deadline_s=10)
    sender.abort(receiver.endpoint, remote)
    sender.abort(receiver.endpoint, remote)
    sender.abort(receiver.endpoint, "never-issued")
    assert sink.expired == [remote]  # a remote abort frees the blocks, exactly once
    assert receiver.state(remote) is TransferState.ABORTED
    assert receiver.open_transfer_ids() == []


@pytest.mark.parametrize("secret", [None, "wrong"])
def test_wrong_or_missing_secret_is_unauthenticated(receiver, sink, src_cache, config, secret):
    tid = receiver.open(DEST, deadline_s=10)
    with pytest.raises(grpc.RpcError) as info:
        push_raw(receiver, [raw_chunk(tid, src_cache[0:1, :, SRC])], secret=secret)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    sender = GrpcKVSender(type(config)(**{**config.__dict__, "secret": "wrong"}))
    with pytest.raises(KVTransferError, match="UNAUTHENTICATED"):
        sender.send(request(receiver, src_cache, tid))
    sender.close()
    assert sink.writes == 0 and receiver.state(tid) is TransferState.OPEN


def test_corrupted_chunk_fails_the_transfer_and_nothing_is_committed(
    receiver, config, sink, src_cache
):
    def flip_last_byte(seq: int, chunk: bytes) -> bytes:
        return chunk[:-1] + bytes([chunk[-1] ^ 0xFF]) if seq == 2 else chunk

    sender = GrpcKVSender(config, tamper=flip_last_byte)
    tid = receiver.open(DEST, deadline_s=10)
    with pytest.raises(KVTransferError, match="DATA_LOSS.*checksum mismatch"):
        sender.send(request(receiver, src_cache, tid))
    sender.close()
    assert sink.commits == {} and sink.expired == [tid]  # its blocks are freed at once
    assert receiver.state(tid) is TransferState.FAILED
    with pytest.raises(grpc.RpcError) as info:  # and it stays dead: no resume
        push_raw(receiver, [raw_chunk(tid, src_cache[2:3, :, SRC], layer_start=2)])
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_chunk_of_wrong_shape_or_dtype_is_rejected(receiver, sink, src_cache):
    tid = receiver.open(DEST, deadline_s=10)
    with pytest.raises(grpc.RpcError) as info:
        push_raw(receiver, [raw_chunk(tid, src_cache[0:1, :, [1, 2]])])  # 2 blocks, not 3
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    tid = receiver.open(DEST, deadline_s=10)
    with pytest.raises(grpc.RpcError) as info:
        push_raw(receiver, [raw_chunk(tid, src_cache[0:1, :, SRC].half())])
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert sink.writes == 0


@pytest.mark.parametrize("seqs", [[1, 0], [0, 0]], ids=["skipped", "repeated"])
def test_chunk_out_of_sequence_is_rejected(receiver, sink, src_cache, seqs):
    tid = receiver.open(DEST, deadline_s=10)
    chunks = [raw_chunk(tid, src_cache[i : i + 1, :, SRC], i, seq=s) for i, s in enumerate(seqs)]
    with pytest.raises(grpc.RpcError) as info:
        push_raw(receiver, chunks)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "seq" in info.value.details() and sink.expired == [tid]


def test_reservation_expires_at_its_deadline(receiver, sink):
    tid = receiver.open(DEST, deadline_s=0.2)
    assert receiver.open_transfer_ids() == [tid]
    assert sink.changed.wait(timeout=5)
    assert sink.expired == [tid]
    assert receiver.open_transfer_ids() == [] and receiver.state(tid) is TransferState.EXPIRED


def test_refused_commit_fails_the_transfer(config, src_cache):
    sink = TensorSink(make_cache(None), refuse_commit=True)
    receiver = make_receiver(config, sink)  # no layout: checked against the first chunk instead
    receiver.start()
    sender = GrpcKVSender(config)
    tid = receiver.open(DEST, deadline_s=10)
    with pytest.raises(KVTransferError, match="FAILED_PRECONDITION.*request was cancelled"):
        sender.send(request(receiver, src_cache, tid))
    sender.close()
    receiver.stop()
    assert sink.expired == [tid] and receiver.state(tid) is TransferState.FAILED


def test_reservation_without_missing_blocks_needs_only_the_commit(
    receiver, sender, sink, src_cache
):
    tid = receiver.open([], deadline_s=10)  # the decode worker already holds the whole prompt
    result = sender.send(request(receiver, src_cache, tid, src_block_ids=[]))
    assert (result.chunks, result.bytes) == (0, 0)
    assert sink.commits[tid].first_token_id == 42 and sink.writes == 0
