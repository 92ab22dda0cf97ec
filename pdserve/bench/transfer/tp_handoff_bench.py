"""`pdserve bench tp-handoff`: one tensor-parallel KV handoff per (P TP, D TP) pair, on each
transport asked for against a baseline transport (grpc unless --baseline says otherwise), in
the same run: each prefill rank's bytes, the READ descriptors of the handoff (nixl; 0
elsewhere), the median seconds of --repeats handoffs after a warm-up, and their ratio to the
baseline's on the same pair.

    pdserve bench tp-handoff [--layers 32 --kv-heads 8 --head-dim 128 --block-size 16]
        [--tokens 512] [--transports nixl,grpc] [--pairs 1>1,1>2,2>1,2>2] [--repeats 3]
        [--ucx-tls tcp] [--json FILE]

Through the shipped path (kv_transfer/tp_handoff.py) over tp_ranks.py's ranks: one real KV
endpoint and, on nixl, one NIXL agent per rank, all in this process on 127.0.0.1. The prompt's
--tokens / --block-size blocks are read from blocks [0, n) into reserved blocks [n, 2n), so at
equal TP every part is one run of blocks. Every decode rank's cache is checked against its
heads of the reference (`exact`); the exit status is 1 when one is not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.bench.transfer.tp_ranks import CacheShape


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=32, help="(default: 32, an 8B model's)")
    p.add_argument("--kv-heads", type=int, default=8, help="(default: 8)")
    p.add_argument("--head-dim", type=int, default=128, help="(default: 128)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens handed off (512)")
    p.add_argument(
        "--transports", default="nixl,grpc", help="comma-separated (grpc, collective, nixl)"
    )
    p.add_argument("--baseline", default="grpc", help="the transport the others are timed against")
    p.add_argument("--pairs", default="1>1,1>2,2>1,2>2", help="P TP>D TP pairs, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed handoffs per pair (median)")
    p.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for nixl (default: tcp)")
    p.add_argument("--json", help="write every row to this file")


@dataclass
class Handoffs:
    """One transport's handoffs of one (P TP, D TP) pair."""

    transport: str
    prefill_tp: int
    decode_tp: int
    rank_bytes: list[int]  # read out by each prefill rank
    descriptors: int  # the READ descriptors of one handoff (nixl)
    median_s: float
    exact: bool  # every decode rank's cache held its heads of the reference


def _pairs(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(x) for x in pair.split(">")) for pair in text.split(",")]
    except ValueError:
        raise SystemExit(f"--pairs: {text!r} is not P>D pairs, e.g. 1>1,1>2") from None
    if not all(len(pair) == 2 and min(pair) >= 1 for pair in pairs):
        raise SystemExit(f"--pairs: {text!r} is not P>D pairs of sizes 1+, e.g. 1>1,1>2")
    return pairs  # type: ignore[return-value]


def _transports(args: argparse.Namespace) -> list[str]:
    transports = list(dict.fromkeys([args.baseline, *args.transports.split(",")]))
    for transport in transports:
        if transport not in ("grpc", "collective", "nixl"):
            raise SystemExit(f"--transports: unknown transport {transport!r}")
    if "nixl" in transports:
        from kv_transfer.nixl_agent import nixl_module

        try:
            nixl_module()
        except ImportError as e:
            raise SystemExit(f"--transports: {e}") from None
    return transports


def measure(
    transport: str,
    prefill_tp: int,
    decode_tp: int,
    shape: CacheShape,
    kv_heads: int,
    tokens: int,
    repeats: int,
    ucx_tls: str,
) -> Handoffs:
    """`repeats` handoffs (after one warm-up) of `tokens` tokens into zeroed decode caches."""
    import torch

    from kv_transfer import CommitInfo
    from pdserve.bench.transfer.tp_ranks import DecodeRanks, PrefillRanks, reference_cache
    from pdserve.config import KVTransferConfig
    from pdserve.models.tp_layout import kv_head_range

    blocks = tokens // shape.block_size
    src, dest = list(range(blocks)), list(range(blocks, 2 * blocks))
    config = KVTransferConfig(
        transport=transport, secret="s", bind_host="127.0.0.1", chunk_bytes=4 << 20,
        reservation_timeout_s=120.0, nixl_ucx_tls=ucx_tls if transport == "nixl" else None,
    )  # fmt: skip
    reference = reference_cache(kv_heads, shape=shape)
    decode = DecodeRanks(config, kv_heads, decode_tp, shape)
    prefill = PrefillRanks(config, reference, prefill_tp)
    commit = CommitInfo(first_token_id=1, num_prompt_tokens=tokens)
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
            for first, end in [kv_head_range(kv_heads, rank, decode_tp)]
        )
    finally:
        prefill.close()
        decode.stop()
    return Handoffs(
        transport,
        prefill_tp,
        decode_tp,
        list(sent.rank_bytes),
        sent.descriptors,
        statistics.median(seconds),
        exact,
    )


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.transfer.tp_ranks import CacheShape

    pairs, transports = _pairs(args.pairs), _transports(args)
    if min(args.layers, args.kv_heads, args.head_dim, args.block_size, args.repeats) < 1:
        raise SystemExit("--layers, --kv-heads, --head-dim, --block-size, --repeats: 1+")
    blocks = args.tokens // args.block_size
    if blocks < 1:
        raise SystemExit("--tokens: at least one block (--block-size tokens)")
    if max(max(pair) for pair in pairs) > args.kv_heads:
        raise SystemExit("--pairs: a TP size above --kv-heads leaves a rank without heads")
    shape = CacheShape(args.layers, 2 * blocks, args.block_size, args.head_dim)
    kv_bytes = args.layers * 2 * blocks * args.block_size * args.kv_heads * args.head_dim * 4
    print(
        f"{args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, {blocks * args.block_size}"
        f" tokens: KV {kv_bytes:,} B (float32); median of {args.repeats}; vs {args.baseline}"
    )
    print(f"{'P->D':<6} {'transport':<11} {'bytes per prefill rank':>24} {'descriptors':>12}"
          f" {'median s':>9} {'/ ' + args.baseline:>8} exact")  # fmt: skip
    rows: list[Handoffs] = []
    for prefill_tp, decode_tp in pairs:
        by_transport = {
            t: measure(
                t,
                prefill_tp,
                decode_tp,
                shape,
                args.kv_heads,
                args.tokens,
                args.repeats,
                args.ucx_tls,
            )  # fmt: skip
            for t in transports
        }
        base = by_transport[args.baseline].median_s
        for t, h in by_transport.items():
            per_rank = f"{h.rank_bytes[0]:,}" + (
                f" x {len(h.rank_bytes)}" if prefill_tp > 1 else ""
            )
            print(
                f"{f'{prefill_tp}->{decode_tp}':<6} {t:<11} {per_rank:>24} {h.descriptors:>12}"
                f" {h.median_s:>9.3f} {h.median_s / base:>7.2f}x {h.exact}",
                flush=True,
            )
        rows += by_transport.values()
    if args.json:
        Path(args.json).write_text(
            json.dumps({"baseline": args.baseline, "handoffs": [asdict(r) for r in rows]}, indent=1)
        )
    return 0 if all(r.exact for r in rows) else 1
