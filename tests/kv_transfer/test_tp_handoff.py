"""A KV handoff between tensor-parallel workers (kv_transfer/tp_handoff.py), over real KV
endpoints, one per decode rank, on grpc, collective (Gloo) and nixl (each rank's own agent
READing exactly its heads from the prefill rank(s) holding them): for (P TP, D TP) in {1, 2, 4}^2
every decode rank's cache holds, byte for byte, its heads of the TP-1 reference, every layer
and position; each prefill rank puts exactly its own heads on the wire; a commit goes through
only once every rank holds its part, and every other end fences every rank."""

from __future__ import annotations

import dataclasses
import itertools
import time

import grpc
import pytest
import torch

from kv_transfer import CommitInfo, KVTransferError
from kv_transfer.grpc_sender import ControlStub
from kv_transfer.reservations import TransferState
from kv_transfer.tp_handoff import SlicedSend, push_own_heads
from pdserve.bench.transfer.tp_ranks import (
    SMALL_CACHE,
    DecodeRanks,
    PrefillRanks,
    reference_cache,
)
from pdserve.models.tp_layout import kv_head_range
from pdserve.pb import kv_transfer_pb2 as pb

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = (
    SMALL_CACHE.layers, SMALL_CACHE.blocks, SMALL_CACHE.block_size, SMALL_CACHE.head_dim,
)  # fmt: skip
SRC, DEST = [1, 2, 5, 8], [3, 7, 9, 0]
COMMIT = CommitInfo(first_token_id=42, first_logprob=-0.5, num_prompt_tokens=13)
HEAD_BYTES = LAYERS * 2 * len(SRC) * BLOCK_SIZE * HEAD_DIM * 4  # one KV head, float32


@pytest.fixture(params=["grpc", "collective", "nixl"])
def tp_config(request, config):
    ucx_tls = "tcp" if request.param == "nixl" else None  # as tests/kv_transfer/test_nixl_*
    return dataclasses.replace(
        config, transport=request.param, reservation_timeout_s=20.0, nixl_ucx_tls=ucx_tls
    )


def handoff(tp_config, kv_heads: int, prefill_tp: int, decode_tp: int):
    reference = reference_cache(kv_heads)
    decode = DecodeRanks(tp_config, kv_heads, decode_tp)
    prefill = PrefillRanks(tp_config, reference, prefill_tp)
    return reference, decode, prefill


def assert_holds_reference(decode: DecodeRanks, reference: torch.Tensor) -> None:
    others = [b for b in range(BLOCKS) if b not in DEST]
    for rank, sink in enumerate(decode.sinks):
        first, end = kv_head_range(reference.shape[4], rank, decode.size)
        assert torch.equal(sink.cache[:, :, DEST], reference[:, :, SRC, :, first:end]), rank
        assert not sink.cache[:, :, others].any(), rank


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), list(itertools.product([1, 2, 4], repeat=2)))
def test_each_decode_rank_holds_its_heads_of_the_reference(tp_config, prefill_tp, decode_tp):
    reference, decode, prefill = handoff(tp_config, 4, prefill_tp, decode_tp)
    try:
        tid = decode.ranked.open(DEST, deadline_s=20)
        sent = prefill.hand_off(decode.ranked.endpoints, tid, SRC, COMMIT)
        assert decode.sinks[0].commits[tid].first_token_id == 42
        assert_holds_reference(decode, reference)
        for receiver in decode.receivers():  # every part sealed: no more writes anywhere
            assert receiver.state(tid) is TransferState.COMMITTED
            assert receiver.open_transfer_ids() == []
        # Each prefill rank sent its own 4 / P heads once, no other rank's: the wire carries
        # the KV's size, nothing gathered on rank 0.
        assert sent.rank_bytes == (4 // prefill_tp * HEAD_BYTES,) * prefill_tp
        assert sent.bytes == reference[:, :, SRC].nbytes
        if tp_config.transport == "nixl":  # one READ per (prefill rank, decode rank) pair
            # Equal TP: each pair's heads are whole blocks on both sides, one descriptor per
            # (layer, K|V, run of blocks consecutive on both sides: SRC and DEST have 4 runs).
            # Else one side holds more heads than the pair moves: one per position.
            per_pair = 2 * LAYERS * (4 if prefill_tp == decode_tp else len(SRC) * BLOCK_SIZE)
            assert sent.descriptors == max(prefill_tp, decode_tp) * per_pair
    finally:
        prefill.close()
        decode.stop()


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "rank_heads"),
    [
        (4, 1, (1, 0, 1, 0)),  # 2 KV heads on 4 prefill ranks: each sent by its first holder
        (1, 4, (4,)),  # ... on 4 decode ranks: each rank needs its copy
        (4, 4, (2, 0, 2, 0)),
    ],
)
def test_replicated_heads(tp_config, prefill_tp, decode_tp, rank_heads):
    reference, decode, prefill = handoff(tp_config, 2, prefill_tp, decode_tp)
    try:
        tid = decode.ranked.open(DEST, deadline_s=20)
        sent = prefill.hand_off(decode.ranked.endpoints, tid, SRC, COMMIT)
        assert_holds_reference(decode, reference)
        assert sent.rank_bytes == tuple(n * HEAD_BYTES for n in rank_heads)
    finally:
        prefill.close()
        decode.stop()


def test_commit_without_every_ranks_part_fences_every_rank(tp_config):
    reference, decode, prefill = handoff(tp_config, 4, 2, 2)
    try:
        tid = decode.ranked.open(DEST, deadline_s=20)
        send = SlicedSend(tuple(decode.ranked.endpoints), tid, SRC, LAYERS, 4, 2)
        push_own_heads(prefill.senders[0], send, 0, prefill.caches[0])  # rank 1 never pushes
        stub = ControlStub.dial(decode.ranked.endpoints[0])
        with pytest.raises(grpc.RpcError) as info:
            stub.commit(
                pb.CommitRequest(transfer_id=tid, first_token_id=42, num_prompt_tokens=13),
                metadata=prefill.senders[0]._client.metadata,
            )
        stub.channel.close()
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert f"commit refused: transfer {tid}: all layers missing" in info.value.details()
        assert decode.sinks[0].commits == {} and decode.sinks[0].expired == [tid]
        assert decode.ranked.own.state(tid) is TransferState.FAILED
        assert decode.followers[0].state(tid) is TransferState.ABORTED
        # The late part finds every rank fenced: nothing more lands in the freed blocks.
        with pytest.raises(KVTransferError, match="FAILED_PRECONDITION"):
            push_own_heads(prefill.senders[1], send, 1, prefill.caches[1])
        assert not decode.sinks[1].cache.any()
    finally:
        prefill.close()
        decode.stop()


def test_a_failed_rank_push_fails_the_handoff_and_its_abort_fences_every_rank(tp_config):
    reference, decode, prefill = handoff(tp_config, 4, 2, 2)

    def corrupt(seq, chunk):  # grpc: encoded bytes; collective: the tensor, in place
        if isinstance(chunk, bytes):
            return chunk[:-1] + bytes([chunk[-1] ^ 0xFF])
        chunk.view(-1)[0] += 1.0
        return None

    prefill.senders[1].tamper = corrupt
    try:
        tid = decode.ranked.open(DEST, deadline_s=20)
        with pytest.raises(KVTransferError):
            prefill.hand_off(decode.ranked.endpoints, tid, SRC, COMMIT)
        assert decode.sinks[0].commits == {}  # rank 0 never committed
        # The prefill worker's caller aborts the transfer on decode rank 0: every rank fenced.
        prefill.senders[0].abort(decode.ranked.endpoints[0], tid)
        assert decode.sinks[0].expired == [tid]
        for receiver in decode.receivers():
            assert receiver.open_transfer_ids() == []
            assert receiver.state(tid) in (TransferState.ABORTED, TransferState.FAILED)
    finally:
        prefill.close()
        decode.stop()


def test_the_deadline_fences_every_rank(tp_config):
    reference, decode, prefill = handoff(tp_config, 4, 1, 4)
    try:
        tid = decode.ranked.open(DEST, deadline_s=0.3)
        time.sleep(0.6)
        assert decode.sinks[0].expired == [tid]
        for receiver in decode.receivers():
            assert receiver.open_transfer_ids() == []
        with pytest.raises(KVTransferError, match="FAILED_PRECONDITION"):
            prefill.hand_off(decode.ranked.endpoints, tid, SRC, COMMIT)
        assert not any(sink.cache.any() for sink in decode.sinks)
    finally:
        prefill.close()
        decode.stop()


def test_decode_side_abort_fences_every_rank(tp_config):
    reference, decode, prefill = handoff(tp_config, 4, 2, 4)
    try:
        tid = decode.ranked.open(DEST, deadline_s=20)
        assert decode.ranked.abort(tid) and not decode.ranked.abort(tid)  # idempotent
        for receiver in decode.receivers():
            assert receiver.state(tid) is TransferState.ABORTED
        with pytest.raises(KVTransferError):
            prefill.hand_off(decode.ranked.endpoints, tid, SRC, COMMIT)
        assert decode.sinks[0].expired == []  # its own abort: the worker frees the blocks
        assert not any(sink.cache.any() for sink in decode.sinks)
    finally:
        prefill.close()
        decode.stop()
