"""Bytes, READ descriptors and seconds of one tensor-parallel KV handoff per (P TP, D TP), on
nixl and the other transports, through the shipped path (kv_transfer/tp_handoff.py) over the
transfer tests' rank harness (tests/kv_transfer/tp_workers.py: one real KV endpoint and, on
nixl, one NIXL agent per rank, all in this process on 127.0.0.1). Every decode rank's cache is
checked against its heads of the reference.

    PYTHONPATH=. python docs/scripts/tp_nixl_handoff.py LAYERS KV_HEADS HEAD_DIM BLOCK_SIZE \\
        TOKENS TRANSPORTS PAIRS REPEATS [UCX_TLS]
    e.g. ... 32 8 128 16 512 nixl,grpc 1>1,1>2,2>1,2>2 3 tcp

(Kept out of pdserve/bench: it drives the test harness; docs/benchmarks/transfer.md quotes it.)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import tests.kv_transfer.tp_workers as ranks
from kv_transfer import CommitInfo
from pdserve.config import KVTransferConfig
from pdserve.models.tp_layout import kv_head_range


def main(argv: list[str]) -> None:
    layers, heads, head_dim, block_size, tokens = (int(x) for x in argv[:5])
    transports, repeats = argv[5].split(","), int(argv[7])
    pairs = [tuple(int(x) for x in pair.split(">")) for pair in argv[6].split(",")]
    ucx_tls = argv[8] if len(argv) > 8 else "tcp"
    blocks = tokens // block_size
    # The harness's cache shape, set to the one measured.
    ranks.LAYERS, ranks.BLOCKS, ranks.BLOCK_SIZE, ranks.HEAD_DIM = (
        layers, 2 * blocks, block_size, head_dim,
    )  # fmt: skip
    src, dest = list(range(blocks)), list(range(blocks, 2 * blocks))
    commit = CommitInfo(first_token_id=1, num_prompt_tokens=tokens)
    kv_bytes = ranks.reference_cache(heads)[:, :, src].nbytes
    print(f"{layers} layers, {heads} KV heads x {head_dim}, {tokens} tokens: KV {kv_bytes:,} B")
    for transport in transports:
        config = KVTransferConfig(
            transport=transport, secret="s", bind_host="127.0.0.1", chunk_bytes=4 << 20,
            reservation_timeout_s=120.0, nixl_ucx_tls=ucx_tls if transport == "nixl" else None,
        )  # fmt: skip
        for prefill_tp, decode_tp in pairs:
            reference = ranks.reference_cache(heads)
            decode = ranks.DecodeRanks(config, heads, decode_tp)
            prefill = ranks.PrefillRanks(config, reference, prefill_tp)
            seconds = []
            try:
                for repeat in range(repeats + 1):  # the first one warms up
                    for sink in decode.sinks:
                        sink.cache.zero_()
                    tid = decode.ranked.open(dest, deadline_s=120)
                    started = time.perf_counter()
                    sent = prefill.hand_off(decode.ranked.endpoints, tid, src, commit)
                    if repeat:
                        seconds.append(time.perf_counter() - started)
                exact = all(
                    torch.equal(sink.cache[:, :, dest], reference[:, :, src, :, first:end])
                    for rank, sink in enumerate(decode.sinks)
                    for first, end in [kv_head_range(heads, rank, decode_tp)]
                )
                print(
                    f"{transport} {prefill_tp}->{decode_tp}: bytes per prefill rank "
                    f"{sent.rank_bytes}, descriptors {sent.descriptors}, median "
                    f"{statistics.median(seconds):.3f} s, exact {exact}",
                    flush=True,
                )
            finally:
                prefill.close()
                decode.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
